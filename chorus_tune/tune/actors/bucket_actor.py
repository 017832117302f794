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
from chorus_tune.tune.actors.liveness import ActorId
from chorus_tune.tune.observe.actor_log import log_to_actor_stdout
from chorus_tune.tune.observe.metrics import BucketMetrics
from chorus_tune.tune.rules.members import MemberBook, Phase, StopRecord
from chorus_tune.tune.rules.regrouping import broken_units, member_view, moved_error
from chorus_tune.tune.rules.resources import bucket_threads, pick_device
from chorus_tune.tune.rules.waits import Evicted, idle_members
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.options import BucketOptions, Join
from chorus_tune.tune.values.plan import Plan

logger = logging.getLogger(__name__)

# States of members that left, kept for a late save. Tune saves a trial's
# checkpoint before it lets the trial go, so few are ever read; each is a whole
# member state on the host.
_RETIRED_KEEP = 16
_MAX_QUEUE = 1024  # results one member may have waiting, whatever the memory allows
_MISSING = object()

# One line per iteration in the bucket's log (the dashboard's Log link): the
# iteration (``chorus/bucket_iteration`` of its results), members in slots /
# slots when it ran, members it trained (``chorus/live``), the rows of the
# stack it computed (``chorus/rows``: the trained ones where the iteration
# gathered them, every slot where masked rows ran too), route, seconds, the
# seconds per fused step, samples/s over all members, and wasted
# member-iterations so far (counted when a member leaves with unread results).
STATUS_LINE = ("%s: iteration %d, live %d/%d, trained %d, rows %d, route %s, %.3f s, step %.2f ms, "
               "%.0f samples/s, wasted %d")


class MemberError(RuntimeError):
    """A call about a member this bucket does not hold."""


def _member_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A core result without the fields the ``chorus/*`` keys report instead."""
    return {k: v for k, v in metrics.items() if k not in ("route", "seed")}


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` as the pool can be sent it: itself, or, where it does not
    pickle (a factory's own exception may hold anything), a RuntimeError with
    its type and message. A notice that failed to pickle would raise here, in
    the bucket's iteration, instead of reaching the pool."""
    if error is None:
        return None
    try:
        cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the message still goes
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _state_bytes(state: dict) -> int:
    import torch

    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class ChorusBucket:
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
        task = cloudpickle.loads(task_blob)
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
        self.book = MemberBook(max_queue=_MAX_QUEUE, gather_s=options.gather_s)
        self.clients: dict[str, ActorId | None] = {}  # member -> the id of the trial actor reading it
        self.retired: OrderedDict[str, tuple[int, dict[int, Any]]] = OrderedDict()  # member -> (taken, states)
        self.reaped: list[str] = []
        self.ever: list[str] = []
        self.iterations = 0
        # Members trained and rows of the stack computed, over every iteration:
        # their ratio is how full the iterations ran (bucket_stats()).
        self.member_iterations = self.rows_computed = 0
        self.compactions = 0
        self._waiters: dict[str, asyncio.Future] = {}
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

    # ----- asyncio plumbing -----------------------------------------------------------------------
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

    # ----- membership -----------------------------------------------------------------------------
    async def expect(self, member: str, client: ActorId | None = None, join: Join | None = None) -> str:
        """Hold a place for ``member``. With ``join`` (a member seated by
        ChorusSearch) it is built now, else on its trial's first request.
        Idempotent."""
        self._start()
        self._expect(member, client, join)
        return self.name

    async def expect_all(self, members: list[tuple[str, ActorId | None, Join | None]]) -> str:
        """:meth:`expect` for each ``(member, client, join)``, in one go: no
        iteration can start between them, so members seated together are all
        being built when the first one is (and train their first iteration together)."""
        self._start()
        for member, client, join in members:
            self._expect(member, client, join)  # not a coroutine: the train loop cannot run in between
        return self.name

    def _expect(self, member: str, client: ActorId | None, join: Join | None) -> None:
        record = self.book.get(member)
        fresh = record is None or record.phase not in (Phase.RESERVED, Phase.TRAINING, Phase.HELD)
        self.book.reserve(member, Plan() if join is None else join.plan)
        if fresh or client is not None:
            # A member id seen before (a restarted trial, a re-seat) starts
            # afresh: the trial actor that read it before may be dead.
            self.clients[member] = client
        self.retired.pop(member, None)
        self.evicted.discard(member)
        if fresh:
            self._fetched.pop(member, None)
        self.moved.pop(member, None)
        if member not in self.ever:
            self.ever.append(member)
        if join is not None and member not in self._joining:
            self._start_build(member, join)

    async def watch(self, member: str, client: ActorId | None) -> None:
        """``client`` (a trial actor's id) reads ``member`` now: if it dies, the
        reaper drops the member. The pool says so when a trial is bound to a
        member seated before it, which it may never read (its actor can die
        first), so the member would hold its slot for good."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT and client is not None and member not in self.moved:
            self.clients[member] = client

    def _start_build(self, member: str, join: Join) -> asyncio.Task:
        self.book.get(member).building = True
        task = asyncio.get_running_loop().create_task(self._build(member, join))
        self._joining[member] = task
        return task

    async def join(self, member: str, join: Join) -> None:
        """Build ``member`` into a slot (fresh, or from ``join.state``). A model
        that cannot be built fails this member only; its trial hears why."""
        self._start()
        record = self.book.get(member)
        if record is None or record.phase is not Phase.RESERVED:
            return
        task = self._joining.get(member)
        if task is None:
            if join is None:
                raise MemberError(f"member {member} asked bucket {self.name} for a result before joining")
            task = self._start_build(member, join)
        await asyncio.shield(task)

    async def _build(self, member: str, join: Join) -> None:
        try:
            state = state_io.loads(join.state) if join.state is not None else None
            async with self._lock:
                record = self.book.get(member)
                if record is None or record.phase is not Phase.RESERVED:
                    return  # it left while waiting for the lock
                if state is None:
                    slot = await self._in_thread(self.core.add, dict(join.config), join.seed)
                else:
                    slot = await self._in_thread(self.core.restore, state, dict(join.config))
                if record.phase is not Phase.RESERVED:
                    # Its trial left while the model was built (a member with no
                    # slot leaves without the lock): no slot may outlive it.
                    self.core.retire(slot)
                    return
                if self.book.get(member).plan == Plan():
                    self.book.set_plan(member, join.plan)  # unless a scheduler's plan came meanwhile
                self.book.place(member, slot, iteration=0 if state is None else int(state["iteration"]),
                                state=state)
                self.book.get(member).cohort = join.cohort  # moved in: its cohort's token (regrouping.py)
                if len(self.core.live_slots) == 1 and self.core.fused_steps == 0:  # first member: structure known
                    logger.info("%s: structure %s; per member: %s; shared configuration: %s", self.name,
                                self.model_name, ", ".join(self.core.stack.settings) or "nothing",
                                "; ".join(self.core.describe_configuration()))
                if self.core.stack.padded:  # what it pays for sharing a bucket of other widths (D9)
                    logger.info("%s: member %s: %s", self.name, member, self.core.describe_padding(slot))
                if self.book.max_queue == _MAX_QUEUE:
                    self._size_queue(slot)
        except Exception as exc:  # noqa: BLE001 - the factory (or state) is this member's problem only
            logger.warning("%s: member %s could not join: %s", self.name, member, exc)
            self.book.fail(member, exc)
            self._resolve(member)
            self._notify_pool(member, "failed", exc)
        finally:
            self._joining.pop(member, None)
            record = self.book.get(member)
            if record is not None:
                record.building = False
        self.metrics.members(self.live, self.core.capacity)
        self._poke()

    def _size_queue(self, slot: int) -> None:
        # Every waiting result keeps its member's state: bound what that costs.
        per_state = max(1, _state_bytes(self.core.member_state(slot)))
        budget = self.options.ahead_memory_mb * 2**20
        self.book.max_queue = int(max(1, min(_MAX_QUEUE, budget // (per_state * self.core.capacity))))

    async def set_threads(self, threads: int) -> None:
        """Use ``threads`` CPU threads from the next iteration on (the pool
        shares a CPU-only machine's cores among the buckets that are open)."""
        import torch

        count = max(1, int(threads))
        torch.set_num_threads(count)  # this thread: the event loop's (states in and out)
        # And the thread that trains: with OpenMP each thread keeps its own count,
        # so one set here never reached an iteration once the worker thread existed
        # (measured: it went on with 2 threads after 1 was set, so two buckets on a
        # 2-core machine ran 4 threads, and a bucket left alone kept 1). Queued behind
        # the running iteration: it applies from the next one.
        await self._in_thread(torch.set_num_threads, count)

    async def set_plan(self, member: str, plan: Plan) -> None:
        """A plan learnt after the member joined (e.g. its scheduler's rungs)."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT:
            self.book.set_plan(member, plan)
            self._poke()

    async def leave(self, member: str, keep_state: bool = True, read: int | None = None) -> bool:
        """``member``'s trial is gone: its slot (if any) is freed, what it
        computed and nobody read counts as wasted. ``read``: the iteration of
        the last result its trial handed Tune (it may have fetched more:
        :meth:`next_results`). Idempotent; returns whether it was here."""
        self._start()
        try:
            return await self._leave(member, keep_state, read)
        finally:
            # A member that has left is watched no more, whichever leave did it:
            # a watch (the pool binding its trial) may come while a leave waits
            # for the running iteration, and a client kept for a member that left
            # would be "reaped" once that trial actor ends.
            record = self.book.get(member)
            if record is None or record.phase is Phase.LEFT:
                self.clients.pop(member, None)

    async def _leave(self, member: str, keep_state: bool, read: int | None = None) -> bool:
        record = self.book.get(member)
        if record is None or record.phase is Phase.LEFT:
            return False
        self.book.read_to(member, read)  # what Tune read counts as read, the rest as wasted
        if keep_state and record.state_at_taken is not None:
            self.retired[member] = self._held_states(record, read)
            while len(self.retired) > _RETIRED_KEEP:
                self.retired.popitem(last=False)
        fetched = self._fetched.pop(member, None)
        if read is not None and fetched is not None and fetched > read:
            logger.debug("%s: %s leaves at iteration %d, its trial had fetched to %d", self.name, member, read,
                         fetched)
        self.clients.pop(member, None)
        wasted = self.book.wasted
        stops = dict(self.book.stops.stopped)
        if record.in_slot:
            async with self._lock:  # slots change only between iterations
                now = self.book.get(member)
                if now is None or now.phase is Phase.LEFT:
                    return False  # a leave that came meanwhile (the reaper's, say) has done it
                slot = self.book.leave(member)
                if slot is not None:
                    self.core.retire(slot)
        else:
            self.book.leave(member)  # no slot: nothing for a running iteration to see
        if self.book.wasted > wasted:
            logger.info("%s: member %s left with %d result(s) unread, wasted %d", self.name, member,
                        self.book.wasted - wasted, self.book.wasted)
        if self.book.stops.stopped != stops and self._pool is not None:
            # Tune stopped a trial early: the run's other buckets learn it too.
            self._pool.stops_seen.remote(self.name, self.book.stops.stopped, self.book.stops.continued)
        self._resolve(member)
        self.metrics.members(self.live, self.core.capacity)
        self.metrics.wasted(self.book.wasted)
        self._poke()
        return True

    async def reset_stops(self) -> None:
        """A new run starts: forget where the last one's scheduler stopped trials."""
        self.book.stops = StopRecord()

    async def stops_elsewhere(self, stopped: dict[int, int], continued: dict[int, int]) -> None:
        """Where Tune stopped the run's trials in its other buckets (from the pool)."""
        self.book.stops.seen_elsewhere(stopped, continued)
        self._poke()

    def _held_states(self, record, read: int | None) -> tuple[int, dict[int, Any]]:
        """The states a save may still ask for once ``record``'s member has
        left: the one at the last result read, and, where its trial did not say
        how far Tune read (an eviction), those of the results it fetched."""
        states = {record.taken: record.state_at_taken}
        if read is None:
            fetched = self._fetched.get(record.member, record.taken)
            states.update({e.iteration: e.state for e in record.queue if e.iteration <= fetched})
        return record.taken, states

    async def save(self, member: str, at: int | None = None) -> bytes | None:
        """``member``'s portable state at the last result its trial handed
        Tune (docs/design.md D7), serialised; ``None`` before its first result.
        ``at``: that result's iteration, where the trial fetched beyond it
        (:meth:`next_results`); ``None``: the last result the bucket delivered.
        A state of another iteration is never given instead: a bucket that
        does not hold the one asked for says so."""
        self._start()
        record = self.book.get(member)
        if member in self.moved and (record is None or record.phase is Phase.LEFT):
            raise moved_error(member, self.name)  # its state is the new bucket's to give
        if record is not None and record.phase is not Phase.LEFT:
            self.book.read_to(member, at)
            if at is not None and record.taken != at:
                raise MemberError(f"bucket {self.name} holds no state of member {member} at iteration {at} "
                                  f"(its trial has read to iteration {record.taken})")
            state = record.state_at_taken
        elif member in self.retired:
            taken, states = self.retired[member]
            state = states.get(taken if at is None else at, _MISSING)
            if state is _MISSING:
                raise MemberError(f"bucket {self.name} holds no state of member {member} at iteration {at} "
                                  f"(it left at iteration {taken})")
        else:
            raise MemberError(f"bucket {self.name} holds no state of member {member}")
        return None if state is None else state_io.dumps(state)

    async def compact(self, expected: list[str] | None = None) -> int | None:
        """Shrink to the members in slots, between iterations: finished slots
        stop costing compute. Refused (``None``) while a member waits to be
        built, and when ``expected`` (the members the pool holds here) are not
        exactly the members in slots: a leave or a join the pool sent is still
        on its way (Ray does not order an async actor's calls), and shrinking
        to this bucket's count would leave the pool offering a slot that does
        not exist. Returns the new capacity."""
        self._start()
        async with self._lock:
            if self.book.reserved() or not self.book.in_slots():
                return None
            if expected is not None and {r.member for r in self.book.in_slots()} != set(expected):
                return None
            if len(self.book.in_slots()) == self.core.capacity:
                return self.core.capacity
            remap = await self._in_thread(self.core.compact)
            self.book.renumber(remap)
            self.compactions += 1
        logger.info("%s: compacted to %d slots", self.name, self.core.capacity)
        self.metrics.compacted(self.live, self.core.capacity)
        return self.core.capacity

    # ----- regrouping: members move to another bucket of their structure (regrouping.py, D3) ------
    async def regroup_view(self) -> dict[str, Any]:
        """What the pool's regrouping rule needs of this bucket: its capacity,
        the members in its slots (``regrouping.MemberView``), those placed here
        but not built yet, and those that moved away whose trials still read
        results left here (``draining``)."""
        self._start()
        draining = [m for m in self.moved if (r := self.book.get(m)) is not None and r.phase is not Phase.LEFT]
        return {"capacity": self.core.capacity, "pending": self.book.reserved(), "draining": draining,
                "members": [member_view(r, self.book.limit(r)) for r in self.book.in_slots()]}

    def _holds(self) -> set[str]:
        return {r.member for r in self.book.in_slots()} | set(self.book.reserved())

    async def reserve_moved(self, members: list[str], expected: list[str]) -> bool:
        """Hold slots for ``members``, which move here from another bucket:
        only while this bucket's book holds exactly ``expected`` (the members
        the pool holds here) and it has the free slots. No iteration starts
        until :meth:`move_in` builds them (they join together) or
        :meth:`cancel_moved` lets them go."""
        self._start()
        async with self._lock:
            if self._holds() != set(expected) or len(self.core.free_slots) - len(self.book.reserved()) < len(members):
                return False
            if any((r := self.book.get(m)) is not None and r.phase is not Phase.LEFT for m in members):
                return False  # results of an earlier stay here still drain
            for member in members:
                self.book.reserve(member, Plan()).building = True
        return True

    async def cancel_moved(self, members: list[str]) -> None:
        """The move of ``members`` (reserved by :meth:`reserve_moved`) did not happen."""
        for member in members:
            record = self.book.get(member)
            if record is not None and record.phase is Phase.RESERVED and member not in self._joining:
                self.book.leave(member)
                record.building = False
        self._poke()

    async def take_out(self, moving: dict[str, str | None], expected: list[str], dest: str) -> list[dict] | None:
        """Take ``moving`` (member -> the cohort token it carries) out of their
        slots, between iterations, for bucket ``dest``: each one's state now,
        config, seed, plan, token and trial actor. Refused (``None``) unless
        this book holds exactly ``expected`` (the members the pool holds here),
        every one can move (``regrouping.member_view``) and no cohort is split
        (``regrouping.broken_units``). Results they queued here stay: their
        trials read them here first, then hear :class:`Moved`."""
        self._start()
        async with self._lock:
            in_slots = self.book.in_slots()
            views = {r.member: member_view(r, self.book.limit(r)) for r in in_slots}
            if (self._holds() != set(expected) or any(m not in views or not views[m].movable for m in moving)
                    or broken_units(views.values(), moving)):
                return None
            out = []
            for member, token in moving.items():
                record = self.book.get(member)
                slot = record.slot
                state = self.core.member_state(slot)  # at record.produced: it goes on from there
                self.book.move_out(member)
                self.core.retire(slot)
                out.append({"member": member, "state": state_io.dumps(state), "config": dict(state["config"]),
                            "seed": int(state["seed"]), "plan": record.plan, "cohort": token,
                            "client": self.clients.get(member), "queued": len(record.queue)})
        for item in out:
            member = item["member"]
            self.moved[member] = dest
            self.clients.pop(member, None)  # the new bucket watches its trial now
            if not item["queued"]:
                self._moved_on(member, raise_moved=False)
        self.metrics.members(self.live, self.core.capacity)
        self._poke()
        return out

    async def move_in(self, items: list[dict]) -> None:
        """Build the members :meth:`take_out` gave (reserved by :meth:`reserve_moved`)
        from their states, all in one go: they train their next iteration
        together, and their cohort tokens keep them apart from this bucket's own."""
        self._start()
        for item in items:  # no await in between: the train loop sees all of them building
            member = item["member"]
            record = self.book.get(member)
            if record is None or record.phase is not Phase.RESERVED:
                continue
            self.moved.pop(member, None)
            self.retired.pop(member, None)
            self.evicted.discard(member)
            self.clients[member] = item["client"]
            if member not in self.ever:
                self.ever.append(member)
            self.book.set_plan(member, item["plan"])
            self._start_build(member, Join(config=item["config"], seed=item["seed"], state=item["state"],
                                           plan=item["plan"], cohort=item["cohort"]))

    def _moved_on(self, member: str, raise_moved: bool = True) -> None:
        """``member`` moved away: once its trial has read every result left
        here, it is gone from this bucket (and its trial, asking, hears
        :class:`Moved`); before that its results are read as ever."""
        record = self.book.get(member)
        if record is not None and record.phase is not Phase.LEFT:
            if record.queue:
                return
            self.book.leave(member)  # nothing unread: nothing wasted
            self._resolve(member)
            self.metrics.members(self.live, self.core.capacity)
        if raise_moved:
            raise moved_error(member, self.name)

    def _notify_pool(self, member: str, reason: str, error: BaseException | None = None) -> None:
        if self._pool is not None:
            self._pool.member_out.remote(self.name, member, reason, _portable(error))

    # ----- what trials read -----------------------------------------------------------------------
    async def next_results(self, member: str, join: Join | None = None, client: ActorId | None = None,
                           read: int | None = None) -> list[dict[str, Any]]:
        """Every result of ``member`` computed and not yet fetched, oldest
        first: at once if one is, else the next one once it is. What a trial
        fetches in one call and its steps return one at a time (docs/design.md
        D3): a call costs the trial far more than Tune's own work per result.

        ``read``: the iteration of the last result the trial handed Tune
        (``None``: none since it joined). The results fetched stay queued here,
        with their states, until a later call says Tune read them
        (:meth:`MemberBook.read_to`), so a save reads the state of the
        iteration Tune read, and a leave counts what it did not as wasted.
        ``join`` as for :meth:`next_result`."""
        self._start()
        record = self.book.get(member)
        if read is not None and record is not None and member not in self.evicted:
            self.book.read_to(member, read)
        first = await self.next_result(member, join, client)
        record = self.book.get(member)
        if first.get(rk.RETIRED) or record is None or record.phase is Phase.LEFT:
            return [first]
        queued = list(record.queue)
        results = [first] + [{**entry.result, rk.AHEAD: len(queued) - i, rk.WASTED: self.book.wasted}
                             for i, entry in enumerate(queued, start=1)]
        self._fetched[member] = results[-1].get(rk.ITERATION, record.taken)
        return results

    async def next_result(self, member: str, join: Join | None = None,
                          client: ActorId | None = None) -> dict[str, Any]:
        """``member``'s next result: at once if computed, else once it is.

        ``join`` is given by a trial on its first request: the member is built
        then (a member seated by ChorusSearch was built already)."""
        self._start()
        if member in self.moved:
            self._moved_on(member)  # Moved, once its trial has read what it left here
        if member in self.evicted:
            raise Evicted(f"member {member} gave its slot in bucket {self.name} to a waiting member: its trial "
                          "had not asked for a result for a while; it rejoins from its last result")
        record = self.book.get(member)
        if record is None or record.phase is Phase.LEFT:
            raise MemberError(f"member {member} is not in bucket {self.name}")
        self._asked_at[member] = time.monotonic()
        if client is not None:
            self.clients[member] = client
        if record.phase is Phase.RESERVED:
            await self.join(member, join)
        if record.phase is Phase.LEFT:  # its trial left while it was being built
            return self._retired_result(member)
        self.book.attach(member)
        previous = self._waiters.pop(member, None)
        if previous is not None and not previous.done():
            previous.set_exception(MemberError(f"member {member} asked bucket {self.name} again before its "
                                               "last request was answered"))
        entry = self.book.ask(member)  # raises the member's build error
        self._send_stops_news()
        if entry is not None:
            self._poke()
            return self._as_read(member, entry)
        if self.book.exhausted(member):
            return self._retired_result(member)
        future = asyncio.get_running_loop().create_future()
        self._waiters[member] = future
        self._poke()
        return await future

    def _send_stops_news(self) -> None:
        """Tune continued a trial where the run's other buckets still wait for
        evidence (docs/design.md D4): they hear this bucket's counts."""
        if self.book.news and self._pool is not None:
            self.book.news = False
            self._pool.stops_seen.remote(self.name, dict(self.book.stops.stopped), dict(self.book.stops.continued))

    def _as_read(self, member: str, entry) -> dict[str, Any]:
        record = self.book.get(member)
        return {**entry.result, rk.AHEAD: len(record.queue), rk.WASTED: self.book.wasted}

    def _retired_result(self, member: str) -> dict[str, Any]:
        record = self.book.get(member)
        last = {} if record is None else {rk.ITERATION: record.taken}
        return {**last, rk.MEMBER: member, rk.BUCKET: self.name, rk.RETIRED: True, "done": True}

    def _resolve(self, member: str) -> None:
        """Answer ``member``'s waiting trial if there is anything to answer."""
        waiter = self._waiters.get(member)
        if waiter is None or waiter.done():
            self._waiters.pop(member, None)
            return
        record = self.book.get(member)
        if member in self.moved and (record is None or record.phase is Phase.LEFT):
            waiter.set_exception(moved_error(member, self.name))
        elif record is None or record.phase is Phase.LEFT:
            waiter.set_result(self._retired_result(member))
        elif record.phase is Phase.FAILED:
            waiter.set_exception(record.error)
        else:
            entry = self.book.deliver(member)
            if entry is not None:
                waiter.set_result(self._as_read(member, entry))
            elif self.book.exhausted(member):
                waiter.set_result(self._retired_result(member))
            else:
                return
        self._waiters.pop(member, None)

    # ----- the training loop ----------------------------------------------------------------------
    async def _train_loop(self) -> None:
        while not self._closed.is_set():
            chosen, wait = self.book.next_iteration(time.monotonic())
            if not chosen:
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
            start = time.perf_counter()
            try:
                out, states = await self._in_thread(self._train, sorted(members))
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
        for member in finished:
            self._notify_pool(member, "finished")
        self._report(len(out), rows, in_slots, capacity, batch, seconds)

    def _rows_cost_alike(self) -> bool:
        """Whether the fused step may compute every row of the stack, trained
        or masked: then members held at a decision point ride along for free.
        Only the compiled route still runs masked rows (for groups of more than
        half the stack: ``Bucket._trains_gathered``); everywhere else an
        iteration gathers the rows it trains, and a rider would cost its row."""
        return self.core.route == "compiled" and self.core.max_group is None

    def _train(self, slots: list[int]) -> tuple[dict[int, dict], dict[int, dict]]:
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
        return {**_member_metrics(metrics), rk.MEMBER: member, rk.BUCKET: self.name, rk.SLOT: slot,
                rk.BUCKET_ITERATION: self.iterations,
                rk.ROUTE: metrics.get("route", self.core.route), rk.ROUTE_REASON: self.core.route_reason.value,
                rk.LIVE: live, rk.ROWS: rows,
                rk.CAPACITY: self.core.capacity, rk.SEED: metrics.get("seed"), rk.COMPACTIONS: self.compactions,
                rk.OOM_RECOVERIES: self.core.oom_recoveries, **self.capacity_fit}

    def _report(self, trained: int, rows: int, in_slots: int, capacity: int, batch: int, seconds: float) -> None:
        steps = self.core.fused_steps - getattr(self, "_steps_seen", 0)
        self._steps_seen = self.core.fused_steps
        samples = steps * batch * trained
        route = self.core.last_route or self.core.route  # the iteration's own (a lone member's eager)
        self.metrics.iteration(steps, samples, seconds, route)
        self.metrics.members(self.live, self.core.capacity)
        self.metrics.wasted(self.book.wasted)
        logger.info(STATUS_LINE, self.name, self.iterations, in_slots, capacity, trained, rows, route,
                    seconds, 1000 * seconds / steps if steps else 0.0, samples / seconds if seconds > 0 else 0.0,
                    self.book.wasted)

    def _batch_size(self) -> int:
        for record in self.book.in_slots():
            try:
                return self.core.task.batch_size_for(self.core.config(record.slot))
            except KeyError:
                continue
        return 0

    # ----- never hang: reap members whose trial actor died ----------------------------------------
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

    # ----- inspection and closing -----------------------------------------------------------------
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
