"""The bucket actor: runs the sweep for its members; trials read their results.

A thin adapter over two Ray-free pieces: the core :class:`chorus_tune.Bucket`
(the fused math) and :class:`~chorus_tune.tune.rules.members.MemberBook` (who trains
next, how far ahead, what each trial reads). One loop trains whoever the book
allows, as fast as the device goes; every result waits in its member's queue
with the member's state of that iteration, and :meth:`ChorusBucket.next_result`
hands the next one to the member's trial (docs/design.md D4).

Concurrency: the actor is asynchronous. The book is touched only on the event
loop; the core only in the worker thread, and only under ``self._lock`` — every
change of slots (join, leave, finish, compaction) and every iteration takes the
lock, so slot numbers never change under a pending operation.

:class:`ChorusBucket` holds the actor's state, its device and threads, what
the pool tells it, and inspection; each other job is a part of its own module,
on that state: :class:`~.bucket_membership.Membership` (members in and out),
:class:`~.bucket_reads.ResultReads` (results and states to trials),
:class:`~.bucket_moves.RegroupMoves` (members moved to another bucket) and
:class:`~.bucket_training.TrainingLoop` (the loop and what it reports).
``MemberError`` and ``STATUS_LINE`` are exported from here.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import RayActorError

from chorus_tune.tune.actors import liveness
from chorus_tune.tune.actors.bucket_actor_values import MAX_QUEUE, STATUS_LINE, MemberError, portable
from chorus_tune.tune.actors.bucket_membership import Membership
from chorus_tune.tune.actors.bucket_moves import RegroupMoves
from chorus_tune.tune.actors.bucket_reads import ResultReads
from chorus_tune.tune.actors.bucket_training import TrainingLoop
from chorus_tune.tune.actors.liveness import ActorId
from chorus_tune.tune.actors.shared_data import load_task_data
from chorus_tune.tune.observe.actor_log import log_to_actor_stdout
from chorus_tune.tune.observe.metrics import BucketMetrics
from chorus_tune.tune.rules.members import MemberBook, Phase, StopRecord
from chorus_tune.tune.rules.resources import bucket_threads, pick_device
from chorus_tune.tune.rules.threads import ThreadChoice
from chorus_tune.tune.rules.waits import idle_members
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.options import BucketOptions
from chorus_tune.tune.values.plan import Plan
from chorus_tune.tune.values.protocol import task_id

__all__ = ["BucketActor", "ChorusBucket", "MemberError", "STATUS_LINE"]

logger = logging.getLogger(__name__)


class ChorusBucket(Membership, ResultReads, RegroupMoves, TrainingLoop):
    """Up to ``bucket_size`` members of one structure, trained fused, ahead of their trials.

    Created by the pool (named, outside every trial's placement group). Its
    ``repr()`` holds only what never changes (Ray captures it once, at
    creation, and the dashboard shows it): model class, ``bucket_size``,
    device. Live state is read where it is read live: :meth:`describe`, the
    ``ray_chorus_*`` metrics, and one status line per iteration in the
    actor's log (:data:`STATUS_LINE`).
    """

    def __init__(self, name: str, task_blob: bytes, options: BucketOptions, model_name: str,
                 pool: Any = None, capacity_fit: dict | None = None):
        import torch

        from chorus_tune.bucket import Bucket
        from chorus_tune.width_rule import NO_LIMIT

        resources = dict(options.resources_per_bucket or ())
        torch.set_num_threads(bucket_threads(resources))
        # What it is offered is a ceiling: each iteration runs on the count measured faster (rules/threads.py).
        self._threads = ThreadChoice(offered=bucket_threads(resources))
        # What the training thread is set to now: unknown until the first iteration sets it there.
        self._training_threads: int | None = None
        task = cloudpickle.loads(task_blob)
        # Its data from the sweep's shared copy, once one process has loaded it.
        load_task_data(task, task_id(task_blob), pool)
        self.name, self.model_name, self.options, self._pool = name, model_name, options, pool
        # An "auto" bucket_size's fit, in every result: the size is the fit's k.
        self.capacity_fit = {} if capacity_fit is None else {rk.CAPACITY_FIT: dict(capacity_fit)}
        # Read off this process (Ray's GPU ids on this node, CUDA_VISIBLE_DEVICES),
        # never off the cluster: a bucket cannot know how many share its node.
        self.choice = pick_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                                  torch.cuda.is_available())
        self.device = self.choice.device
        self.node_id = ray.get_runtime_context().get_node_id()
        if self.choice.fell_back:
            logger.warning("%s: Ray gave it GPU %s (%s), but torch has no CUDA here: it trains on the CPU",
                           name, ",".join(self.choice.gpu_ids), self.choice.requested)
        # Widths pad (docs/design.md D9): the pool sends only members its width groups
        # put together (their padding within the width rule), so this bucket does not
        # judge again; a member whose padding disagrees has no other bucket to go to,
        # so this one runs eager instead.
        self.core = Bucket(task, options.bucket_size, device=self.device, route=options.route,
                           width_rule=NO_LIMIT, padding_mismatch="eager")
        self.book = MemberBook(max_queue=MAX_QUEUE, gather_s=options.gather_s)
        self.clients: dict[str, ActorId | None] = {}  # member -> the id of the trial actor reading it
        self.retired: OrderedDict[str, tuple[int, dict[int, Any]]] = OrderedDict()  # member -> (taken, states)
        self.reaped: list[str] = []
        self.ever: list[str] = []
        self.iterations = 0
        # Members trained and rows of the stack computed, over every iteration:
        # their ratio is how full the iterations ran (bucket_stats()).
        self.member_iterations = self.rows_computed = 0
        self.compactions = 0
        self._unfused_warmed = False  # bucket_training._warm_while_waiting: once per bucket
        self._waiters: dict[str, asyncio.Future] = {}
        self._held_logged: set[tuple[str, int]] = set()  # reads the read order held, logged once each
        self._asked_at: dict[str, float] = {}  # member -> when its trial last asked for a result
        # member -> the iteration of the last result its trial fetched (next_results):
        # the results after its ``taken`` up to this one may be in its trial's hands.
        self._fetched: dict[str, int] = {}
        self.evicted: set[str] = set()  # members whose slot went to a waiting member (evict_idle)
        self.moved: dict[str, str] = {}  # members that train in another bucket now (regrouping) -> that bucket
        self._joining: dict[str, asyncio.Task] = {}
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-bucket")
        self.metrics = BucketMetrics(name, model_name)
        self.metrics.members(0, options.bucket_size)
        if pool is not None:
            # The pool records where the bucket runs (its stats keep it after
            # the bucket is gone) and shares each node's cores among its buckets.
            pool.bucket_started.remote(name, self.where())
        log_to_actor_stdout(logger)

    def __repr__(self) -> str:
        # bucket_size, not the slots now: compaction shrinks those.
        return f"ChorusBucket({self.model_name}, bucket_size={self.options.bucket_size}, {self.device})"

    @property
    def live(self) -> int:
        return len(self.book.in_slots())

    def _start(self) -> None:
        # The actor's event loop exists only inside async methods.
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._closed = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._train_loop()), loop.create_task(self._reap_loop())]

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def set_threads(self, threads: int) -> None:
        """Use up to ``threads`` CPU threads from the next iteration on (the pool
        shares a CPU-only machine's cores among the buckets that are open):
        each iteration runs on one or on all of them, whichever this bucket
        measured faster a step (``rules/threads.ThreadChoice``)."""
        import torch

        count = max(1, int(threads))
        torch.set_num_threads(count)  # this thread: the event loop's (states in and out)
        # The thread that trains is set by each iteration itself (bucket_training._train):
        # with OpenMP each thread keeps its own count, so one set here never reached an
        # iteration once the worker thread existed (measured: it went on with 2 threads
        # after 1 was set, so two buckets on a 2-core machine ran 4 threads).
        self._threads.offer(count)

    async def set_plan(self, member: str, plan: Plan) -> None:
        """A plan learnt after the member joined (e.g. its scheduler's rungs)."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT:
            self.book.set_plan(member, plan)
            self._poke()

    async def reset_stops(self) -> None:
        """A new run starts: forget where the last one's scheduler stopped trials."""
        self.book.stops = StopRecord()

    async def stops_elsewhere(self, stopped: dict[int, int], continued: dict[int, int]) -> None:
        """Where Tune stopped the run's trials in its other buckets (from the pool)."""
        self.book.stops.seen_elsewhere(stopped, continued)
        self._poke()

    def _notify_pool(self, member: str, reason: str, error: BaseException | None = None) -> Any:
        """Tell the pool ``member`` no longer needs its slot; the pool's answer
        (the members it placed here instead), or ``None`` without a pool."""
        if self._pool is None:
            return None
        return self._pool.member_out.remote(self.name, member, reason, portable(error))

    def _send_stops_news(self) -> None:
        """Tune stopped a trial early, or continued one where the run's other
        buckets still wait for evidence (docs/design.md D4): they hear this
        bucket's counts."""
        if self.book.news and self._pool is not None:
            self.book.news = False
            self._pool.stops_seen.remote(self.name, dict(self.book.stops.stopped), dict(self.book.stops.continued))

    async def _reap_loop(self) -> None:
        while not self._closed.is_set():
            await asyncio.sleep(self.options.reap_interval_s)
            if self._pool is not None and await self._pool_dead():
                await self._orphaned()
                return
            try:
                self.metrics.refresh()  # an idle bucket's gauges stay on the metrics endpoint (refresh says why)
                watched = {member: client for member, client in self.clients.items()
                           if client is not None and member not in self._waiters}  # a waiting trial is alive
                dead = await asyncio.to_thread(liveness.dead_among, set(watched.values()))
                for member, client in watched.items():
                    # Looked at again after the lookup: the member may have a new
                    # reader by now, or its trial may be waiting for a result (alive).
                    if client in dead and self.clients.get(member) == client and member not in self._waiters:
                        # Also after a normal stop: Tune ends the actor, and its
                        # trial's leave may reach us after the reaper looked.
                        if await self.leave(member, keep_state=False):  # False: it had left already
                            logger.info("%s: dropped %s: the trial actor reading it is gone", self.name, member)
                            self.reaped.append(member)
                            self._notify_pool(member, "reaped")
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                logger.exception("%s: reaper", self.name)

    async def _orphaned(self) -> None:
        """The pool that made this bucket died (docs/design.md "Faults": the pool
        is lost). Nobody can place members here or close it any more, and it
        would hold its GPU for good while a new pool's buckets wait for one: it
        answers its waiting trials, saying why, and ends itself. Their trials
        restart from their checkpoints in the new pool's buckets."""
        logger.warning("%s: its pool died: closing (its trials restart from their checkpoints)", self.name)
        await self.close(reason="its pool died")
        await asyncio.sleep(0.5)  # let the answers to waiting trials leave before the process ends
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _pool_dead(self) -> bool:
        try:
            ref = self._pool.__ray_ready__.remote()
            await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=max(1.0, self.options.reap_interval_s))
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - busy or unreachable for now: not known dead
            return False
        return False

    def where(self) -> dict[str, Any]:
        """Where the bucket runs: its node, its device, the device it was given."""
        return {"node_id": self.node_id, "device": self.device, "requested_device": self.choice.requested,
                "gpu_ids": list(self.choice.gpu_ids)}

    async def describe(self) -> dict[str, Any]:
        records = self.book.records
        return {
            "name": self.name, "model": self.model_name, "repr": repr(self),
            "capacity": self.core.capacity, "live": self.live,
            "members": {m: r.slot for m, r in records.items() if r.in_slot},
            "phases": {m: r.phase.value for m, r in records.items()},
            "produced": {m: r.produced for m, r in records.items()},
            "ever": list(self.ever), "reaped": list(self.reaped),
            "route": self.core.route, "route_report": self.core.route_report(),
            "iterations": self.iterations, "fused_steps": self.core.fused_steps,
            "member_iterations": self.member_iterations, "rows_computed": self.rows_computed,
            "compactions": self.compactions, "wasted": self.book.wasted, "max_queue": self.book.max_queue,
            **self.where(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(), "oom_recoveries": self.core.oom_recoveries,
            "decision_points": list(self.book.stops.points),
        }

    async def evict_idle(self, idle_s: float) -> list[str]:
        """Members in slots whose trials have read from them but not asked for
        a result for ``idle_s`` leave, keeping their state at the last result
        read (:meth:`save` still serves it); the pool gives their slots to
        waiting members. A trial that asks again hears :class:`Evicted` and
        rejoins from that state, on the same trajectory."""
        self._start()
        read = [r.member for r in self.book.in_slots() if r.taken >= 1 and not r.building]
        out = idle_members(self._asked_at, read, set(self._waiters), time.monotonic(), idle_s)
        for member in out:
            logger.info("%s: %s gives its slot to a waiting member: its trial has not asked for a result "
                        "for %.0fs", self.name, member, idle_s)
            await self.leave(member, keep_state=True)
            self.evicted.add(member)
        return out

    async def progress(self) -> int:
        """Iterations run so far (the pool's progress count for waiting trials)."""
        return self.iterations

    async def drained(self) -> bool:
        """Nothing left here that a trial could still read (the pool may close it)."""
        return all(r.drained for r in self.book.records.values())

    async def wait_closed(self) -> None:
        """Returns when the bucket closes; raises if it dies (the pool's death watch)."""
        self._start()
        await self._closed.wait()

    async def close(self, reason: str | None = None) -> None:
        self._start()
        why = f"bucket {self.name} was closed" + (f": {reason}" if reason else "")
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(MemberError(why))
        self._closed.set()
        self._poke()
        for task in self._tasks:
            task.cancel()


BucketActor = ray.remote(ChorusBucket)
