"""The bucket actor: a core :class:`chorus_tune.Bucket` behind a lockstep (DESIGN D2, D4).

Trial actors call :meth:`ChorusBucket.step`; the call returns when the
bucket's next iteration has run, which happens once every expected member has
asked for it (:class:`~chorus_tune.tune.lockstep.Lockstep`). The actor is
asynchronous: while one iteration runs in a worker thread, leaves, saves and
reaping are still answered, and they touch the core bucket only between
iterations (one lock guards it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import RayActorError

from . import state_io
from .lockstep import Lockstep
from .metrics import BucketMetrics
from .options import BucketOptions, Join
from .resources import bucket_threads

logger = logging.getLogger(__name__)

RETIRED = "chorus/retired"
_RETIRED_KEEP = 256  # states of retired members kept for a late save (checkpoint at end)


class MemberError(RuntimeError):
    """A call about a member this bucket does not hold."""


class LockstepTimeout(RuntimeError):
    """A lockstep iteration waited too long for members that never asked for it."""


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class ChorusBucket:
    """Up to ``bucket_size`` trials' members, trained fused in lockstep.

    Created by the pool (named, outside every trial's placement group).
    ``repr()`` shows the model class and live/capacity members.
    """

    def __init__(self, name: str, task_blob: bytes, options: BucketOptions, model_name: str,
                 pool: Any = None):
        import torch

        from chorus_tune.bucket import Bucket

        resources = dict(options.resources_per_bucket or ())
        torch.set_num_threads(bucket_threads(resources))
        task = cloudpickle.loads(task_blob)
        gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.name, self.model_name, self.options, self._pool = name, model_name, options, pool
        self.core = Bucket(task, options.bucket_size, device="cuda" if gpu else "cpu", route=options.route)
        self.lockstep = Lockstep(options.bucket_size, options.gather_s)
        self.slots: dict[str, int] = {}
        # Members that left but whose slot the core still trains until the
        # leave gets the lock: compaction must renumber these too.
        self._leaving: dict[str, int] = {}
        self.clients: dict[str, Any] = {}
        self.parked: dict[str, bytes] = {}
        self.retired: OrderedDict[str, bytes] = OrderedDict()
        self.last_metrics: dict[str, dict] = {}
        self.reaped: list[str] = []
        self.ever: list[str] = []
        self.iterations = 0
        self.compactions = 0
        self._waiters: dict[str, asyncio.Future] = {}
        self._running = False
        self._lock: asyncio.Lock | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-bucket")
        self._watchdog: asyncio.Task | None = None
        self._closed: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.metrics = BucketMetrics(name, model_name)
        self.metrics.members(0, options.bucket_size)

    def __repr__(self) -> str:
        return f"ChorusBucket({self.model_name}, {self.live}/{self.core.capacity} live, route={self.core.route})"

    @property
    def live(self) -> int:
        return len(self.slots)

    # ----- asyncio plumbing -----------------------------------------------------------------------
    def _start(self) -> None:
        # The actor's event loop exists only inside async methods.
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._closed = asyncio.Event()
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ----- membership -----------------------------------------------------------------------------
    async def expect(self, member: str, client: Any = None) -> str:
        """Reserve a place for ``member``: iterations wait for it from now on."""
        self._start()
        if member in self.lockstep.expected or member in self.parked:
            self.clients[member] = client
            return self.name
        self.lockstep.expect(member)
        self.retired.pop(member, None)
        self.clients[member] = client
        if member not in self.ever:
            self.ever.append(member)
        return self.name

    async def step(self, member: str, join: Join | None = None) -> dict[str, Any]:
        """Ask for ``member``'s next iteration; returns its result once the bucket ran it.

        ``join`` is given on the member's first request: it enters a slot
        then (fresh, or from ``join.state``)."""
        self._start()
        if member in self.parked:
            await self._unpark(member)
        if member not in self.lockstep.expected:
            if member in self.retired:
                raise MemberError(f"trial {member} was retired from bucket {self.name}; "
                                  "it cannot train further")
            raise MemberError(f"trial {member} is not a member of bucket {self.name}")
        if member not in self.slots:
            if join is None:
                raise MemberError(f"trial {member} asked bucket {self.name} for an iteration before joining")
            await self._join(member, join)
        previous = self._waiters.get(member)
        if previous is not None and not previous.done():
            previous.set_exception(MemberError(f"trial {member} asked bucket {self.name} again before its "
                                               "last request was answered"))
        future = asyncio.get_running_loop().create_future()
        self._waiters[member] = future
        self.lockstep.request(member)
        self._schedule()
        return await future

    async def _join(self, member: str, join: Join) -> None:
        state = state_io.loads(join.state) if join.state is not None else None
        async with self._lock:
            try:
                slot = await self._in_thread(self.core.add, dict(join.config), join.seed, state)
            except BaseException:
                # The factory (or the state) is this trial's problem only: the
                # bucket stops waiting for it and its other members go on.
                self._forget(member)
                self._notify_pool_left(member)
                raise
            self._seat(member, slot, "joining")
        self.metrics.members(self.live, self.core.capacity)

    def _seat(self, member: str, slot: int, doing: str, state: bytes | None = None) -> None:
        """Give ``member`` the core slot just filled for it, unless it left while
        that was done (waiting for the lock): then no slot may outlive it, and
        ``state``, if any, is kept for a late save."""
        if member not in self.lockstep.expected:
            self.core.retire(slot)
            if state is not None:
                self.retired[member] = state
            raise MemberError(f"trial {member} left bucket {self.name} while {doing} it")
        self.slots[member] = slot

    async def leave(self, member: str, keep_state: bool = True) -> bool:
        """``member`` leaves: its slot is freed (its state kept for a late save).
        Idempotent; returns whether it was here."""
        self._start()
        known = member in self.lockstep.expected or member in self.parked or member in self.slots
        self.lockstep.drop(member)
        waiter = self._waiters.pop(member, None)
        if waiter is not None and not waiter.done():
            # A request not yet taken into an iteration: answer it as retired.
            waiter.set_result({**self.last_metrics.get(member, {}), RETIRED: True, "done": True})
        state = self.parked.pop(member, None)
        slot = self.slots.pop(member, None)
        self.clients.pop(member, None)
        if slot is not None:
            self._leaving[member] = slot
            try:
                async with self._lock:
                    slot = self._leaving[member]  # a compaction may have renumbered it meanwhile
                    if keep_state:
                        state = await self._in_thread(self._dump, slot)
                    self.core.retire(slot)
            finally:
                self._leaving.pop(member, None)
        if keep_state and state is not None:
            self.retired[member] = state
            while len(self.retired) > _RETIRED_KEEP:
                self.retired.popitem(last=False)
        self.metrics.members(self.live, self.core.capacity)
        self._schedule()
        return known

    async def save(self, member: str) -> bytes:
        """``member``'s portable state (DESIGN D7), serialised."""
        self._start()
        if member in self.slots:
            async with self._lock:
                if member in self.slots:
                    return await self._in_thread(self._dump, self.slots[member])
        if member in self.parked:
            return self.parked[member]
        if member in self.retired:
            return self.retired[member]
        raise MemberError(f"bucket {self.name} holds no state of trial {member}")

    def _dump(self, slot: int) -> bytes:
        return state_io.dumps(self.core.member_state(slot))

    def _forget(self, member: str) -> None:
        self.lockstep.drop(member)
        self.clients.pop(member, None)
        self.slots.pop(member, None)
        self.parked.pop(member, None)

    def _notify_pool_left(self, member: str, reason: str | None = None) -> None:
        if self._pool is not None:
            self._pool.leave.remote(member, False, reason)

    async def _park(self, member: str) -> None:
        """Free a member's slot but keep its state, and stop waiting for it."""
        slot = self.slots.get(member)
        if slot is None or self._running:
            return
        async with self._lock:
            if self.slots.get(member) != slot or member in self.lockstep.requested:
                return
            state = await self._in_thread(self._dump, slot)
            # It may have asked for its next iteration, or left, while its
            # state was being saved: parking it now would orphan that request.
            if self.slots.get(member) != slot or member in self.lockstep.requested:
                return
            self.core.retire(slot)
            del self.slots[member]
            self.parked[member] = state
            self.lockstep.drop(member)
        logger.info("%s: parked %s (no request %.1fs after the others)", self.name, member,
                    self.options.park_after_s)
        self.metrics.members(self.live, self.core.capacity)
        self._schedule()

    async def _unpark(self, member: str) -> None:
        state = self.parked.pop(member)
        self.lockstep.expect(member)
        async with self._lock:
            decoded = state_io.loads(state)
            slot = await self._in_thread(self.core.add, decoded["config"], None, decoded)
            self._seat(member, slot, "rejoining", state)
        self.metrics.members(self.live, self.core.capacity)

    async def compact(self) -> int | None:
        """Shrink to the live members between iterations (issue 4): finished
        slots stop costing compute. Refused (``None``) while a member is
        reserved but not joined, or parked: each of those needs a slot.
        Returns the new capacity."""
        self._start()
        members = set(self.lockstep.expected) | set(self.parked)
        if not self.slots or set(self.slots) != members or self.parked or self._leaving:
            return None
        async with self._lock:
            # A leave still waiting for the lock holds a slot the core trains:
            # shrinking now would keep it. Its own leave asks for compaction again.
            if set(self.slots) != set(self.lockstep.expected) or self.parked or self._leaving:
                return None
            remap = await self._in_thread(self.core.compact)
            self.slots = {m: remap[slot] for m, slot in self.slots.items()}
            self._leaving = {m: remap[slot] for m, slot in self._leaving.items()}
            self.lockstep.capacity = self.core.capacity
            self.compactions += 1
        logger.info("%s: compacted to %d slots", self.name, self.core.capacity)
        self.metrics.compacted(self.live, self.core.capacity)
        self._schedule()
        return self.core.capacity

    # ----- the lockstep iteration -----------------------------------------------------------------
    def _schedule(self) -> None:
        if self._running or self._lock is None:
            return
        delay = self.lockstep.ready_in()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        if delay > 0:
            if self._timer is None or self._timer.when() > loop.time() + delay + 1e-3:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_later(delay, self._schedule_from_timer)
            return
        self._running = True
        loop.create_task(self._run())

    def _schedule_from_timer(self) -> None:
        self._timer = None
        self._schedule()

    async def _run(self) -> None:
        try:
            async with self._lock:
                if self.lockstep.ready_in() != 0:
                    return
                members = self.lockstep.take()
                start = time.perf_counter()
                try:
                    out = await self._in_thread(self.core.run_iteration)
                except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                    logger.exception("%s: iteration failed", self.name)
                    for m in members:
                        waiter = self._waiters.pop(m, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_exception(exc)
                    return
                seconds = time.perf_counter() - start
            self._deliver(members, out, seconds)
        finally:
            self._running = False
            self._schedule()

    def _deliver(self, members: list[str], out: dict[int, dict], seconds: float) -> None:
        self.iterations += 1
        by_slot = {slot: m for m, slot in self.slots.items()}
        cohort = {}
        for slot, metrics in out.items():
            m = by_slot.get(slot)
            if m is not None:
                cohort[m] = {"iteration": metrics.get("iteration"), **_numeric(metrics)}
        cohort_json = json.dumps(cohort, sort_keys=True)
        for m in members:
            waiter = self._waiters.pop(m, None)
            slot = self.slots.get(m)
            if waiter is None or waiter.done():
                continue
            if slot is None or slot not in out:
                waiter.set_exception(MemberError(f"trial {m} left bucket {self.name} during its iteration"))
                continue
            metrics = dict(out[slot])
            route, seed = metrics.pop("route", self.core.route), metrics.pop("seed", None)
            result = {**metrics, "chorus/bucket": self.name, "chorus/slot": slot, "chorus/route": route,
                      "chorus/live": len(out), "chorus/seed": seed, "chorus/cohort": cohort_json,
                      "chorus/capacity": self.core.capacity, "chorus/compactions": self.compactions}
            self.last_metrics[m] = result
            waiter.set_result(result)
        steps = self.core.fused_steps - getattr(self, "_steps_seen", 0)
        self._steps_seen = self.core.fused_steps
        batch = self._batch_size()
        self.metrics.iteration(steps, steps * batch * len(out), seconds, self.core.route)
        self.metrics.members(self.live, self.core.capacity)

    def _batch_size(self) -> int:
        for slot in self.slots.values():
            try:
                return self.core.task.batch_size_for(self.core.config(slot))
            except KeyError:
                continue
        return 0

    # ----- never hang (issue 3, "Faults") ---------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.options.reap_interval_s)
            try:
                await self._check_waits()
            except Exception:  # noqa: BLE001 - the watchdog must survive anything
                logger.exception("%s: watchdog", self.name)

    async def _check_waits(self) -> None:
        if self._running or not self.lockstep.requested:
            return
        for m in self.lockstep.missing():
            if await self._client_dead(m):
                logger.warning("%s: reaping %s: its trial actor died", self.name, m)
                self.reaped.append(m)
                await self.leave(m, keep_state=False)
                self._notify_pool_left(m, "reaped")
        waited = self.lockstep.waiting_for_s()
        park_after = self.options.park_after_s
        if park_after is not None and waited > park_after:
            for m in self.lockstep.missing():
                await self._park(m)
        missing = self.lockstep.missing()
        if missing and self.lockstep.waiting_for_s() > self.options.lockstep_timeout_s:
            names = ", ".join(f"{m} ({'slot %d' % self.slots[m] if m in self.slots else 'not joined'})"
                              for m in missing)
            error = LockstepTimeout(
                f"bucket {self.name}: iteration waited {waited:.1f}s (lockstep_timeout_s="
                f"{self.options.lockstep_timeout_s}) for member(s) that never asked for it: {names}")
            for m in self.lockstep.take():
                waiter = self._waiters.pop(m, None)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(error)

    async def _client_dead(self, member: str) -> bool:
        client = self.clients.get(member)
        if client is None:
            return False
        try:
            ref = client.__ray_ready__.remote()
            await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=max(1.0, self.options.reap_interval_s))
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - busy or unreachable for now: not known dead
            return False
        return False

    # ----- inspection and closing -----------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "model": self.model_name, "repr": repr(self),
            "capacity": self.core.capacity, "live": self.live,
            "members": {m: s for m, s in self.slots.items()}, "parked": list(self.parked),
            "expected": self.lockstep.expected, "ever": list(self.ever), "reaped": list(self.reaped),
            "route": self.core.route, "iterations": self.iterations, "fused_steps": self.core.fused_steps,
            "compactions": self.compactions,
        }

    async def wait_closed(self) -> None:
        """Returns when the bucket closes; raises if it dies (the pool's death watch)."""
        self._start()
        await self._closed.wait()

    async def close(self) -> None:
        self._start()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(MemberError(f"bucket {self.name} was closed"))
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.cancel()


BucketActor = ray.remote(ChorusBucket)
