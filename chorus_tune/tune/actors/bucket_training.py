"""The bucket actor's part that trains (docs/design.md D4, D12): the loop that runs an
iteration whenever members may train, the core bucket's iteration in a worker thread, each
member's result with its ``chorus/*`` fields, failures kept to their members, and the status
line and metrics of every iteration. A part of
:class:`~chorus_tune.tune.actors.bucket_actor.ChorusBucket` (its state is the actor's)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from chorus_tune.tune.actors.bucket_actor_values import (
    STATUS_LINE,
    member_metrics,
)
from chorus_tune.tune.rules.members import Phase
from chorus_tune.tune.values import result_keys as rk

# The bucket's one log: its __init__ sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.bucket_actor")


def _log_failed_warm(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("warming torch.optim failed (a member trained unfused pays for it): %r", future.exception())


# How long a bucket waits for the pool's answer to the slots it freed (a few
# ms normally): the next iteration starts without the refill after that.
_REFILL_ANSWER_S = 0.5


class TrainingLoop:
    """The training loop and what each iteration reports (ChorusBucket's part; see the module)."""

    async def _train_loop(self) -> None:
        while not self._closed.is_set():
            chosen, wait = self.book.next_iteration(time.monotonic())
            if not chosen:
                self._warm_while_waiting()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._iterate()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("%s: training loop", self.name)

    def _warm_while_waiting(self) -> None:
        """Once, while members wait for Tune's decisions: pay in the training
        thread what this process's first member trained unfused would pay on
        its trial's critical path (``Bucket.warm_unfused``: 0.65 s measured).
        Only once Tune was seen stopping a trial of the run (a stock scheduler
        decides, and lets members go on one trial at a time): under FIFO a
        bucket waits only for its trials' round trip, and its next iteration,
        fused, would queue behind the warming (not measured to matter: FIFO's
        32 x 10 row took 10.4-11.8 s either way, 3 interleaved runs each).
        Not before the first iteration (it would delay the first results),
        nor once no member is in a slot."""
        if (self._unfused_warmed or not self.iterations or not self.live
                or not self.book.stops.any_stopped):
            return
        self._unfused_warmed = True
        # Queued in the training thread: an iteration that comes meanwhile waits
        # for it there, as its first unfused member would have.
        future = asyncio.get_running_loop().run_in_executor(self._executor, self.core.warm_unfused)
        future.add_done_callback(_log_failed_warm)

    async def _iterate(self) -> None:
        async with self._lock:
            # Membership may have changed while the lock was held elsewhere.
            chosen, _ = self.book.next_iteration(time.monotonic(), gather=False, ride=self._rows_cost_alike())
            if not chosen:
                return
            self.book.started(chosen)
            members = {r.slot: r.member for r in chosen}
            # As this iteration found them: finishing members free their slots before the report.
            in_slots, capacity, batch = self.live, self.core.capacity, self._batch_size()
            threads, steps_before = self._threads.choose(len(members)), self.core.fused_steps
            start = time.perf_counter()
            try:
                out, states = await self._in_thread(self._train, sorted(members), threads)
            except Exception as exc:  # noqa: BLE001 - every member of the iteration must hear of it
                from chorus_tune.bucket import MemberFailure

                if not isinstance(exc, MemberFailure):
                    logger.exception("%s: iteration failed", self.name)
                    self._fail_members(members, exc)
                    return
                # The others finished their iteration (in smaller groups after
                # running out of memory); only the members that ran out even
                # alone, or whose task metric failed, fail, each with its own
                # message (a plain error: their trial actors must not need torch to read it).
                logger.warning("%s: %s", self.name, exc)
                for slot, message in exc.errors.items():
                    self._fail_members({slot: members[slot]}, RuntimeError(message))
                out = exc.results
                states = await self._in_thread(self._states, sorted(out))
            seconds = time.perf_counter() - start
            if self.core.fused_steps > steps_before:
                self._threads.observe(threads, len(members), seconds / (self.core.fused_steps - steps_before),
                                      routes=self.core.last_routes)
            self.iterations += 1
            rows = self.core.last_rows
            self.member_iterations += len(out)
            self.rows_computed += rows
            outputs = {members[slot]: (self._result(members[slot], slot, metrics, len(out), rows), states[slot])
                       for slot, metrics in out.items()}
            freed = self.book.record(outputs)
            for slot in freed:
                self.core.retire(slot)
        finished = [m for m in outputs if self.book.get(m).phase is Phase.FINISHED]
        for member in outputs:
            self._resolve(member)
        self._report(len(out), rows, in_slots, capacity, batch, seconds, threads)
        await self._hand_back(finished)

    async def _hand_back(self, finished: list[str]) -> None:
        """Tell the pool ``finished`` members free their slots, and hear which
        members it placed here in their stead: the next iteration waits for
        those (``MemberBook.expect_refill``, at most ``gather_s``) rather than
        starting without them. The answer is waited for at most
        ``_REFILL_ANSWER_S``; without one, the next iteration waits for nobody."""
        if not finished or self._pool is None:
            return
        refs = [self._notify_pool(member, "finished") for member in finished]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*refs), _REFILL_ANSWER_S)
        except Exception:  # noqa: BLE001 - a slow or lost pool: the refill comes when it comes
            return
        placed = [member for answer in answers for member in (answer or ())]
        if placed:
            self.book.expect_refill(placed, time.monotonic() + self.options.gather_s)
            self._poke()

    def _rows_cost_alike(self) -> bool:
        """Whether the fused step may compute every row of the stack, trained
        or masked: then members held at a decision point ride along for free.
        Only the compiled route still runs masked rows (for groups of more than
        half the stack: ``Bucket._trains_gathered``); everywhere else an
        iteration gathers the rows it trains, and a rider would cost its row."""
        return self.core.route == "compiled" and self.core.max_group is None

    def _train(self, slots: list[int], threads: int) -> tuple[dict[int, dict], dict[int, dict]]:
        if threads != self._training_threads:  # in the training thread: OpenMP keeps a count per thread
            import torch

            torch.set_num_threads(threads)
            self._training_threads = threads
        out = self.core.run_iteration(slots)
        return out, self._states(out)

    def _states(self, slots) -> dict[int, dict]:
        return {slot: self.core.member_state(slot) for slot in slots}

    def _fail_members(self, members: dict[int, str], error: BaseException) -> None:
        for slot, member in members.items():
            self.book.fail(member, error)
            self.core.retire(slot)
            self._resolve(member)
            self._notify_pool(member, "failed", error)

    def _result(self, member: str, slot: int, metrics: dict, live: int, rows: int) -> dict[str, Any]:
        return {**member_metrics(metrics), rk.MEMBER: member, rk.BUCKET: self.name, rk.SLOT: slot,
                rk.BUCKET_ITERATION: self.iterations,
                rk.ROUTE: metrics.get("route", self.core.route), rk.ROUTE_REASON: self.core.route_reason.value,
                rk.LIVE: live, rk.ROWS: rows,
                rk.CAPACITY: self.core.capacity, rk.SEED: metrics.get("seed"), rk.COMPACTIONS: self.compactions,
                rk.OOM_RECOVERIES: self.core.oom_recoveries, **self.capacity_fit}

    def _report(self, trained: int, rows: int, in_slots: int, capacity: int, batch: int, seconds: float,
                threads: int) -> None:
        steps = self.core.fused_steps - getattr(self, "_steps_seen", 0)
        self._steps_seen = self.core.fused_steps
        samples = steps * batch * trained
        route = self.core.last_route or self.core.route  # the iteration's own (a lone member's eager)
        self.metrics.iteration(steps, samples, seconds, route)
        self.metrics.members(self.live, self.core.capacity)
        self.metrics.wasted(self.book.wasted)
        logger.info(STATUS_LINE, self.name, self.iterations, in_slots, capacity, trained, rows, route, threads,
                    seconds, 1000 * seconds / steps if steps else 0.0, samples / seconds if seconds > 0 else 0.0,
                    self.book.wasted)

    def _batch_size(self) -> int:
        for record in self.book.in_slots():
            try:
                return self.core.task.batch_size_for(self.core.config(record.slot))
            except KeyError:
                continue
        return 0
