"""The pool: one named actor per Tune run that places trials into buckets (docs/design.md D2).

**How the driver and the trainables find it.** The pool is named
``chorus-pool-<job id>`` in the Ray namespace ``chorus_tune``. A Tune run's
trial actors belong to the job of the driver that started the run, so the
driver (e.g. a scheduler's ``on_trial_result``) and every trainable derive the
same name from ``ray.get_runtime_context().get_job_id()``, with nothing to pass
around. The first trainable to need the pool creates it. It is detached (a
pool owned by that trial actor would die with it) and closes itself and its
buckets when its job ends; ``Tuner.restore`` in a new driver therefore gets a
new pool with fresh buckets. Successive ``Tuner.fit`` calls in one driver share
the pool (their buckets are closed when empty).

Buckets are created by the pool, with ``scheduling_strategy="DEFAULT"``: Tune
captures child actors into the trial's placement group, and a bucket created
there would die with that trial. On a cluster, Ray puts each bucket where its
resources are (a GPU on any node); the pool itself lives on the head node
(:mod:`chorus_tune.tune.actors.cluster`), so losing a worker node never loses it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, Hashable

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import RayActorError

from chorus_tune.tune.actors.cluster import node_cpus
from chorus_tune.tune.actors.liveness import dead_among
from chorus_tune.tune.actors.sizing import fit_summary, measure_bucket_size
from chorus_tune.tune.observe.actor_log import log_to_actor_stdout
from chorus_tune.tune.rules.bucket_history import BucketHistory
from chorus_tune.tune.rules.closing import Watches, compact_after_s, compaction_due, idle_close_s, stays_idle
from chorus_tune.tune.rules.grouping import GroupKey, split_from, width_device
from chorus_tune.tune.rules.leaving import Leaving
from chorus_tune.tune.rules.opening import actor_options, new_bucket_options
from chorus_tune.tune.rules.placement import Placed, Placement, Update
from chorus_tune.tune.rules.readers import Readers
from chorus_tune.tune.rules.regrouping import BucketView, Move, plan_regroup
from chorus_tune.tune.rules.resources import bucket_budget, bucket_resources, shared_threads
from chorus_tune.tune.rules.run_stops import RunStops
from chorus_tune.tune.rules.scouts import Scouts
from chorus_tune.tune.rules.seat_book import SeatBook
from chorus_tune.tune.rules.solo import is_solo_key, lone_members, may_train_solo, solo_key
from chorus_tune.tune.rules.wait_status import what_it_waits_for, word_wait
from chorus_tune.tune.rules.waits import EVICT_IDLE_S, asks_to_evict
from chorus_tune.tune.values.options import BucketOptions, Join, RungSchedule
from chorus_tune.tune.values.plan import Plan
from chorus_tune.tune.values.protocol import NAMESPACE, NEED_TASK, SOLO, Reservation, bucket_prefix

logger = logging.getLogger(__name__)

_JOB_POLL_S = 2.0
# How often the pool looks again for sparse buckets to regroup: a member that could not move
# when a member left (being built, held at a rung, a join still on its way) may move later.
_REGROUP_POLL_S = 2.0
_DRAIN_POLL_S = 0.2
_SOLO_REAP_S = 1.0  # how often the pool looks for solo members whose trial actor died (a bucket's reap_interval_s)
# Why a member left, in its bucket's history: an earlier run seated it and no trial ever read it.
UNREAD_AT_NEW_RUN = "unread when a new run started"
_COMPACT_TRIES = 3  # a compaction the bucket refuses is tried this often in all (its membership was moving)
_REALIZE_WAIT_S = 5.0  # reserve waits this long for its bucket, then the trial waits in await_placement


def _next_generation(job_id: str) -> int:
    """How many pools this job made before this one (Ray's internal KV keeps the count)."""
    from ray.experimental import internal_kv

    key = f"chorus_tune/pools/{job_id}".encode()
    try:
        seen = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        generation = int(seen) if seen is not None else 0
        internal_kv._internal_kv_put(key, str(generation + 1).encode(), overwrite=True, namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - outside Ray (a local test): the first pool
        return 0
    return generation


class ChorusPool:
    """Maps members to buckets, trials to members; creates, watches and closes buckets.

    A *member* is what a bucket trains. A trial reads one member: the member
    ChorusSearch seated for it before Tune created it (:meth:`seat`, then
    :meth:`bind`), or one of its own, named by its trial id and built on its
    first request (:meth:`reserve`).
    """

    def __init__(self, job_id: str):
        # The first seat unpickles the task (which imports torch, about 1.5
        # CPU-s) and builds a model on the meta device for its structural key:
        # that lies on the path to the first bucket. The pool is created while
        # Tune sets up the run, so import now, beside the event loop (a request
        # that needs torch meanwhile waits on the import lock, never imports twice).
        threading.Thread(target=_preload_torch, name="chorus-pool-preload", daemon=True).start()
        self.job_id = job_id
        # A pool made after this job's first one died (docs/design.md "Faults")
        # names its buckets apart: the dead pool's buckets may still be closing.
        self.generation = _next_generation(job_id)
        self.placement: Placement | None = None
        self.tasks: dict[str, Any] = {}
        self.blobs: dict[str, bytes] = {}
        self.handles: dict[str, Any] = {}
        # Every group key seen, to itself. Read its fields by name (key.options);
        # the map only keeps index reads of older code working.
        self.key_info: dict[GroupKey, GroupKey] = {}
        self.clients: dict[str, str | None] = {}  # trial or member -> its trial actor's id (liveness.py)
        self.history = BucketHistory()
        self.seats = SeatBook()  # seated members, those that cannot be built, and each member's home bucket
        self.readers = Readers()  # trial id -> the member it reads (or the seated one it is bound to)
        self.plans: dict[str, RungSchedule] = {}  # trial id -> rungs ChorusASHA announced
        self._waiting: dict[str, asyncio.Future] = {}
        self._closing = Watches()  # buckets closing once drained
        self._idle = Watches()  # empty buckets waiting to be drained before they close
        self.leaving = Leaving()  # members whose bucket is not yet told they left: not placed again until it is
        # members whose placement failed, or that failed in their bucket: why, for a trial that asks later
        self._unplaced: dict[str, BaseException] = {}
        self._sizing: dict[GroupKey, asyncio.Future] = {}  # key -> its "auto" bucket size measurement
        self._width_groups: dict[str, Any] = {}  # device type -> the width_rule.WidthGroups trials are grouped in
        self._prices: dict[str, Any] = {}  # task id -> its widths.PaddingPrices (an input row, once widths differ)
        self._solo: set[str] = set()  # places in the budget whose member its trial trains (rules/solo.py)
        # ChorusSearch without task= (see ChorusSearch._send_scout): its scout
        # trials, and their members held back for their cohort.
        self.scouts = Scouts(lambda delay_s, callback: asyncio.get_running_loop().call_later(delay_s, callback))
        self._stops = RunStops()  # where Tune stopped trials early, per bucket: shared across the run
        # Regrouping (regrouping.py): members that moved with results still to
        # read in their old bucket -> that bucket; keys being regrouped now, and
        # those asked again meanwhile; cohort tokens handed out.
        self._draining: dict[str, str] = {}
        self._regrouping: set[GroupKey] = set()
        self._regroup_again: set[GroupKey] = set()
        self._tokens = 0
        # Counts every change of membership, start and loss: with the buckets'
        # iterations, what tells a long wait from a stalled one (wait_status).
        self._events = 0
        self._started = False

    def __repr__(self) -> str:
        # The dashboard's Actors page shows this (captured once, at creation).
        return f"ChorusPool(job {self.job_id})"

    def _start(self) -> None:
        if not self._started:
            self._started = True
            log_to_actor_stdout(logger)  # its waits and losses, in the pool actor's own log
            asyncio.get_running_loop().create_task(self._watch_job())
            asyncio.get_running_loop().create_task(self._regroup_loop())
            asyncio.get_running_loop().create_task(self._reap_solo_loop())

    def _learn_task(self, task_id_: str, task_blob: bytes | None) -> bool:
        if task_id_ not in self.tasks:
            if task_blob is None:
                return False
            self.tasks[task_id_] = cloudpickle.loads(task_blob)
            self.blobs[task_id_] = task_blob
        return True

    def _key(self, task_id_: str, options: BucketOptions, config: dict) -> GroupKey:
        if self.placement is None:
            self.placement = Placement(self._budget(options), prefix=bucket_prefix(self.job_id, self.generation))
        else:
            # Successive runs in one driver may size their buckets differently.
            self.placement.max_buckets = self._budget(options)
        task = self.tasks[task_id_]
        from chorus_tune.stack import sharing_key
        from chorus_tune.width_rule import WidthGroups
        from chorus_tune.widths import PaddingPrices

        # Widths pad: trials whose widths the width rule lets pad together share buckets
        # (docs/design.md D9), grouped in the order they come, priced by multiply-adds as
        # a bucket prices them (the task's data is loaded here once, for one input row,
        # when a structure's widths first differ). Raises the factory's own error for a
        # bad config.
        device = width_device(self._bucket_resources(options))
        prices = self._prices.setdefault(task_id_, PaddingPrices(task.input_row))
        skey = sharing_key(task, config, self._width_groups.setdefault(device, WidthGroups(device_type=device)),
                           prices)
        key = GroupKey(task_id_, options, self._model_name(task, config), skey)
        if key not in self.key_info:
            _log_split(key, split_from(key, self.key_info))
        self.key_info.setdefault(key, key)
        return key

    # ----- members seated ahead of their trials (ChorusSearch) ------------------------------------
    async def seat(self, seats: list[tuple[str, dict, int]], task_id_: str, task_blob: bytes | None,
                   options: BucketOptions, plan: Plan) -> dict[str, str] | str:
        """Seat members ``(member, config, seed)`` in buckets of their structure
        now, before any trial reads them: each starts training as soon as it
        has a slot. All are placed before any is built, so members seated
        together train (and reach their rungs) together. Returns, per member,
        ``"seated"``, ``"queued"`` (every bucket of its key is full), ``"solo"``
        (its trial trains it, when its place in the budget is free: rules/solo.py) or
        ``"failed"`` (its model cannot be built: the trial bound to it fails
        with the factory's error); or ``NEED_TASK``."""
        self._start()
        if not self._learn_task(task_id_, task_blob):
            return NEED_TASK
        out, placements, keyed = {}, [], []
        for member, config, seed in seats:
            if self.scouts.release(member) is not None:
                # A scout's member: seated now, first, with the cohort it waited for.
                self.seats.unseat(member)
            if self.seats.is_kept(member):
                # Seated again (ChorusSearch restored in this job): kept as it is.
                # (A trial that read some of its results and left made it leave.)
                out[member] = self.seats.status(member)
                continue
            try:
                key = self._key(task_id_, options, config)
                size = await self._bucket_size(key, options, config)
            except Exception as exc:  # noqa: BLE001 - the factory's (or the sizing's) error, for this member's trial
                self.seats.fail(member, exc)
                out[member] = "failed"
                continue
            keyed.append((member, config, seed, key, size))
        # Decided over the whole seating, before any is placed: members seated
        # together are the ones that would share a bucket (rules/solo.py).
        solo = (lone_members([(m, k) for m, _, _, k, _ in keyed], self._key_in_pool)
                if may_train_solo(ray.cluster_resources(), options) else set())
        for member, config, seed, key, size in keyed:
            self.seats.seat(member, Join(config=dict(config), seed=int(seed), plan=plan))
            placed = self._request(member, solo_key(key, member), 1) if member in solo else self._request(
                member, key, size)
            out[member] = "solo" if member in solo else "queued" if placed is None else "seated"
            if placed is not None:
                placements.append(placed)
        # Not awaited: a new bucket actor takes seconds to start (it imports
        # torch), and the trials Tune starts meanwhile wait for their member's
        # placement in their own first step, in parallel with it.
        self._realize_all(placements)
        return out

    def _key_in_pool(self, key: GroupKey) -> bool:
        """Whether a member of ``key`` is seated, waiting or in a bucket already (a solo member's key is its own)."""
        if self.placement is None:
            return False
        return (any(record.key == key for record in self.placement.buckets.values())
                or self.placement.waiting_for(key) > 0)

    async def bind(self, trial_id: str, candidates: list[str]) -> str | None:
        """Bind Tune's new trial to one of ``candidates`` (seated members, oldest
        first): one with a bucket before one still waiting for a slot, so the
        trials Tune runs read results that exist. Returns the member; for a
        trial that runs already, the candidate it reads, or ``None`` when it
        reads a member of its own."""
        return self.readers.bind(trial_id, candidates, self.seats.is_seated, self.seats.is_housed)

    # ----- trials in ------------------------------------------------------------------------------
    # ----- a search that learns its task from its first trial (a scout) --------------------------
    async def expect_scout(self, trial_id: str, seat: tuple[str, dict, int]) -> None:
        """ChorusSearch (no ``task=``) hands Tune ``trial_id`` first: when its
        first step reserves, it teaches the pool its task, and it reads the
        member ``seat`` (``(member, config, seed)``), placed with the cohort
        the search seats next."""
        self.scouts.expect(trial_id, seat)

    async def scout_task(self, trial_id: str) -> tuple[str, BucketOptions] | None:
        """``(task id, options)`` the scout reserved with, once it has."""
        return self.scouts.taught(trial_id)

    def _hold_scout(self, trial_id: str, task_id_: str, options: BucketOptions) -> str:
        member, config, seed = self.scouts.arrived(trial_id, task_id_, options)
        key = self._key(task_id_, options, config)  # the factory's error, for the scout's trial
        self.seats.seat(member, Join(config=dict(config), seed=int(seed), plan=options.plan()))
        self.readers.bind_to(trial_id, member)
        self.scouts.hold(member, key, lambda m: asyncio.get_running_loop().create_task(self._place_held(m)))
        return member

    async def _place_held(self, member: str) -> None:
        key = self.scouts.release(member)
        if key is None:
            return  # seated with its cohort, or left, before its wait was over
        logger.warning("pool: scout member %s waited %.0f s for its cohort; placed alone", member,
                       self.scouts.wait_s)
        options = key.options
        size = await self._bucket_size(key, options, self.seats.join_of(member).config)
        placed = self._request(member, key, size)
        if placed is not None:
            await self._realize_waiting([placed])

    async def reserve(self, trial_id: str, task_id_: str, task_blob: bytes | None, config: dict,
                      options: BucketOptions, client: str | None = None, seed: int | None = None):
        """Where ``trial_id`` reads its results: a :class:`Reservation`, or
        ``NEED_TASK`` when the pool has not seen this task yet (call again with
        its bytes). A trial bound to a seated member reads that member; any
        other gets a member of its own (named by its trial id, seeded with
        ``seed``), placed in a bucket of its structure. Never waits for a
        slot (the trial waits in :meth:`await_placement`, saying what for);
        it may wait for the trial's last member to leave its bucket, at most
        that bucket's running iteration. Raises what the model factory raises
        for ``config``."""
        self._start()
        if not self._learn_task(task_id_, task_blob):
            return NEED_TASK
        self.clients[trial_id] = client
        if self.readers.is_reading(trial_id):
            # A trial reserving again is a restart (a new actor, a recovery, a
            # restore in this job): what its member holds is stale for it. It
            # gets a member of its own (restored from its checkpoint, if any).
            await self.trial_left(trial_id)
        # Its member's name (its trial id) comes back only once its last leave
        # reached the bucket (leaving.py says what happened before: an actor's
        # leave is not waited for, and the bucket holds it to the iteration's end).
        await self.leaving.finished(trial_id, options.result_timeout_s)
        if self.scouts.is_expected(trial_id):
            self._hold_scout(trial_id, task_id_, options)
        member = self.readers.bound_member(trial_id, self.seats.is_seated)  # None once lost with its bucket
        token = self.readers.start(trial_id, trial_id if member is None else member)
        if member is not None:
            failure = self.seats.failure(member)
            if failure is not None:
                raise failure
            seat = self.seats.join_of(member)
            home, name = self.seats.home(member), self._read_from(member)
            # Its bucket watches this trial's actor from now on, not only once
            # it first reads: an actor that dies before would leave the member
            # holding its slot for good.
            self.clients[member] = client
            if home in self.handles and client is not None:
                self.handles[home].watch.remote(member, client)
            return Reservation(member, seat.seed, seat.plan, name, self.handles.get(name), True, token,
                               solo=name in self._solo)
        key = self._key(task_id_, options, config)
        size = await self._bucket_size(key, options, config)
        plan = options.plan(self.plans.get(trial_id))
        seed = int(seed) if seed is not None else 0
        placed = self._request(trial_id, key, size)
        if placed is None:
            logger.info("pool: %s waits for a bucket (all %s in use)", trial_id, self.placement.max_buckets)
            return Reservation(trial_id, seed, plan, None, None, False, token)
        # A new bucket may wait long to start (for a GPU another bucket holds):
        # the trial then waits in await_placement, which says what it waits for
        # and ends (docs/design.md "Faults: every wait ends"), not in here.
        realizing = asyncio.get_running_loop().create_task(self._realize_waiting([placed]))
        await asyncio.wait({realizing}, timeout=_REALIZE_WAIT_S)
        if trial_id in self._unplaced:
            raise self._unplaced.pop(trial_id)
        name = self._read_from(trial_id)
        return Reservation(trial_id, seed, plan, name, self.handles.get(name), False, token)

    async def await_placement(self, member: str):
        """``(bucket name, handle)`` of a member waiting for a slot, once it has one
        (and its bucket expects it)."""
        if member in self._unplaced:
            raise self._unplaced[member]
        name = self._read_from(member)
        if name is None:
            placed = self.scouts.is_held(member) or self.placement is not None and (
                self.placement.is_waiting(member) or self.placement.bucket_of(member) is not None)
            if not placed:
                raise RuntimeError(f"member {member} is neither placed nor waiting for a bucket")
            future = self._waiting.setdefault(member, asyncio.get_running_loop().create_future())
            name = await future
        return name, SOLO if name in self._solo else self.handles[name]

    def _request(self, member: str, key: GroupKey, size: int) -> Placed | None:
        """The placement's answer for ``member``; an empty bucket of another key
        whose budget it took closes once its trials have read every result."""
        placed = self.placement.request(member, key, size)
        for empty in placed.replaces if placed is not None else ():
            logger.info("pool: %s takes the budget of idle bucket %s", member, empty)
            asyncio.get_running_loop().create_task(self._close_when_drained(empty))
        return placed

    def _realize_all(self, placements: list[Placed]) -> None:
        """Realize ``placements`` in the background, one task per bucket: the
        members placed in one bucket together reach it in one call."""
        by_bucket: dict[str, list[Placed]] = {}
        for placed in placements:
            by_bucket.setdefault(placed.bucket, []).append(placed)
        for group in by_bucket.values():
            asyncio.get_running_loop().create_task(self._realize_waiting(group))

    async def _realize_waiting(self, group: list[Placed]) -> None:
        try:
            await self._realize(group)
        except Exception as exc:  # noqa: BLE001 - the waiting trials hear of it
            for placed in group:
                logger.error("pool: placing member %s in bucket %s failed: %r", placed.trial_id, placed.bucket, exc)
                # Kept for a trial that asks later: with no one told, it would wait forever.
                self._unplaced[placed.trial_id] = exc
                future = self._waiting.pop(placed.trial_id, None)
                if future is not None and not future.done():
                    future.set_exception(exc)

    # ----- what the run's buckets learn of Tune's decisions ----------------------------------------
    async def stops_seen(self, name: str, stopped: dict[int, int], continued: dict[int, int]) -> None:
        """Bucket ``name`` saw Tune stop a trial early, or continue one where the run still gathers
        evidence (docs/design.md D4): tell the run's other buckets."""
        self._stops.seen(name, stopped, continued)
        for other in list(self.handles):
            if other != name:
                self._send_stops(other)

    async def new_run(self, seated_by: str) -> None:
        """A new Tune run starts in this driver (ChorusSearch says so): where
        the last run's scheduler stopped trials says nothing of this one's, and
        the members earlier runs seated that no trial reads leave. Those named
        ``seated_by`` (the prefix of the member names the run's own search
        seats) stay: Ray does not keep the order of an async actor's calls
        (docs: "Actor Task Execution Order"), so this one may run after the
        run's first seats. A restore in this driver keeps its search's
        prefix, and so its seats, as before.

        Tune tells a searcher nothing when a run ends early (a stopper's
        ``stop_all``, ``time_budget_s``, ``fail_fast``): the members seated
        ahead of it stayed, trained, unread, for good, their bucket never
        drained, and the next run's trials waited for its budget for ever
        (measured: a second fit in one driver at ``max_buckets=1`` hung). One
        run at a time per driver is assumed, as for the stop counts above."""
        self._start()
        self._stops.clear()
        for handle in list(self.handles.values()):
            handle.reset_stops.remote()
        unread = self.seats.unread(self.readers.members_read(), spare=seated_by)
        if self.placement is not None:
            # Queued ones first: a placed one's slot must not go to one about to leave.
            unread.sort(key=lambda member: not self.placement.is_waiting(member))
        # All forgotten before the first await: no seat can come between them.
        gone = [(member, *self._forget(member, UNREAD_AT_NEW_RUN)) for member in unread]
        if gone:
            logger.info("pool: a new run starts; %d members seated before and never read leave: %s",
                        len(gone), [member for member, _, _ in gone])
        for member, name, update in gone:
            await self._left(member, name, update)

    def _send_stops(self, name: str) -> None:
        counts = self._stops.elsewhere(name)
        if counts is not None and name in self.handles:
            self.handles[name].stops_elsewhere.remote(*counts)

    async def _realize(self, group: list[Placed]) -> None:
        """Make placements in one bucket real: create the bucket actor if new,
        and have it expect the members (and build them now, those seated), in
        one call. One call per member reached a new bucket apart under load,
        and two of a cohort of eight seated together trained an iteration
        before the other six arrived (a cohort must reach its rungs together)."""
        name = group[0].bucket
        if is_solo_key(self.placement.buckets[name].key):
            self._realize_solo(group[0])
            return
        if any(p.opened for p in group) or name not in self.handles:
            record = self.placement.buckets[name]
            tid, options, model_name, _ = self.key_info[record.key]
            resources = self._bucket_resources(options)
            fit = self._fit_of(record.key)
            from chorus_tune.tune.actors.bucket_actor import BucketActor

            handle = BucketActor.options(**actor_options(name, NAMESPACE, resources)).remote(
                name, self.blobs[tid], new_bucket_options(options, record.capacity, resources), model_name,
                ray.get_runtime_context().current_actor, capacity_fit=fit)
            self.handles[name] = handle
            self._send_stops(name)  # a bucket opened mid-run knows the decision points already
            self._share_cores()
            self.history.opened(name, model_name, record.capacity, record.ever, fit, at=time.monotonic())
            asyncio.get_running_loop().create_task(self._watch_bucket(name, handle))
        members = [p.trial_id for p in group]
        handle = self.handles[name]
        await handle.expect_all.remote([(m, self.clients.get(m), self.seats.join_of(m)) for m in members])
        for member in members:
            if self.placement.bucket_of(member) != name:
                # It left while the bucket was being told (a new bucket's actor
                # takes seconds to start): its leave found no home to tell, so the
                # bucket would train it, unread, for good, and never drain. Seen as
                # a restore in one driver re-seated a member its restarted trial
                # no longer read: the idle bucket held the bucket budget and the
                # next run's trials waited for it.
                with contextlib.suppress(RayActorError):
                    await handle.leave.remote(member, keep_state=False)
                continue
            # Known as its home only once the bucket expects it: a trial that asks
            # the bucket before then would find no such member there.
            self.seats.house(member, name)
            self._events += 1
            future = self._waiting.pop(member, None)
            if future is not None and not future.done():
                future.set_result(name)

    def _realize_solo(self, placed: Placed) -> None:
        """A solo member's place in the budget is its home: no actor starts;
        its trial trains it (rules/solo.py)."""
        name, member = placed.bucket, placed.trial_id
        if placed.opened:
            record = self.placement.buckets[name]
            self._solo.add(name)
            now = time.monotonic()
            self.history.opened(name, record.key.model_name, 1, record.ever, None,
                                at=now, solo=True)
            self.history.started(name, {"node_id": None, "device": "cpu", "requested_device": "cpu",
                                        "gpu_ids": []}, at=now)
        self.seats.house(member, name)
        self._events += 1
        future = self._waiting.pop(member, None)
        if future is not None and not future.done():
            future.set_result(name)

    @staticmethod
    def _model_name(task, config: dict) -> str:
        import torch

        try:
            with torch.device("meta"):
                return type(task.model(config)).__name__
        except Exception:  # noqa: BLE001 - a name only; the structural key already vetted config
            return "?"

    def _budget(self, options: BucketOptions) -> int:
        if options.max_buckets is not None:
            return options.max_buckets
        return bucket_budget(ray.cluster_resources(), self._bucket_resources(options))

    @staticmethod
    def _bucket_resources(options: BucketOptions) -> dict[str, float]:
        return bucket_resources(options.resources_per_bucket, ray.cluster_resources())

    async def _bucket_size(self, key: GroupKey, options: BucketOptions, config: dict) -> int:
        """Slots for a new bucket of ``key``: ``bucket_size``, or for ``"auto"``
        the size measured once per key (concurrent callers share the one
        measurement; a key too big for even one member fails every member of
        it with the measurement's error)."""
        if not options.auto:
            return options.bucket_size
        if key not in self._sizing:
            self._sizing[key] = asyncio.ensure_future(measure_bucket_size(
                self.tasks[key.task_id], self.blobs[key.task_id], config, options, self._bucket_resources(options)))
            self._sizing[key].add_done_callback(lambda done: _log_size(key, done))  # once per key
        fit = await asyncio.shield(self._sizing[key])
        return fit.k

    async def bucket_size_for(self, task_id_: str, options: BucketOptions, config: dict) -> int:
        """Slots of a new bucket for members like ``config`` (measured, for ``"auto"``)."""
        return await self._bucket_size(self._key(task_id_, options, config), options, config)

    def _fit_of(self, key: GroupKey) -> dict | None:
        sizing = self._sizing.get(key)
        if sizing is None or not sizing.done() or sizing.exception() is not None:
            return None
        return fit_summary(sizing.result())

    # ----- plans ------------------------------------------------------------------------------------
    async def set_plan(self, trial_id: str, schedule: RungSchedule) -> None:
        """ChorusASHA's rungs for ``trial_id``: used when its own member joins,
        and sent to its bucket if it has joined already. (A seated member knew
        its rungs when it was seated.)"""
        self.plans[trial_id] = schedule
        name = self.seats.home(trial_id)
        if self.readers.is_bound(trial_id) or name is None:
            return
        record = self.placement.buckets.get(name) if self.placement else None
        if record is not None and name in self.handles:
            try:
                await self.handles[name].set_plan.remote(trial_id, record.key.options.plan(schedule))
            except RayActorError:
                pass

    # ----- members out ----------------------------------------------------------------------------
    async def trial_left(self, trial_id: str, token: int | None = None, read: int | None = None) -> None:
        """Trial ``trial_id`` ended (or its actor moved on): the member it read
        leaves, and the trial is bound to nothing. Idempotent. ``token``: the
        reservation's; a late call from an actor that served an earlier run of
        this trial (a restart, a restore in this job) then changes nothing.
        ``read``: the iteration of the last result the trial handed Tune (it
        may have fetched more), for its bucket's waste and stop counts."""
        if not self.readers.is_current(trial_id, token):
            return
        self.plans.pop(trial_id, None)
        member = self.readers.leave(trial_id)
        if member is not None:
            await self.leave(member, read=read)

    async def leave(self, member: str, notify_bucket: bool = True, reason: str | None = None,
                    read: int | None = None) -> None:
        """``member`` is no longer read: it leaves its bucket (or stops
        waiting). Idempotent; a no-op for a member the pool never saw.
        ``reason`` (e.g. ``"reaped"``) is recorded in the bucket's history;
        ``read`` as for :meth:`trial_left`."""
        self._start()
        name, update = self._forget(member, reason)
        await self._left(member, name, update, notify_bucket, read)

    def _forget(self, member: str, reason: str | None) -> tuple[str | None, Update]:
        """The pool's own part of ``member`` leaving, with no await: its home
        bucket (``None``: none), and what its freed slot set in motion."""
        self.scouts.release(member)
        name = self.seats.leave(member)
        self._unplaced.pop(member, None)
        future = self._waiting.pop(member, None)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"member {member} left before it was placed"))
        self.clients.pop(member, None)
        if reason is not None:
            # A member placed in a bucket that has not yet said it expects it
            # has no home yet: its history is still that bucket's.
            placed_in = self.placement.bucket_of(member) if self.placement is not None else None
            self.history.note(name or placed_in, reason, member)
        update = self.placement.remove(member) if self.placement is not None else Update()
        self.leaving.start(member)  # ended by _left, which always follows
        return name, update

    async def _left(self, member: str, name: str | None, update: Update, notify_bucket: bool = True,
                    read: int | None = None) -> None:
        """The rest of ``member`` leaving (see :meth:`_forget`): its bucket is told, the update applied."""
        try:
            if name is not None and notify_bucket and name in self.handles:
                try:
                    await self.handles[name].leave.remote(member, read=read)
                except RayActorError:
                    pass  # the bucket died: its death watch cleans up
            source = self._draining.pop(member, None)
            if source is not None and source in self.handles:
                # It moved, with results unread in its old bucket: they go too.
                with contextlib.suppress(RayActorError):
                    await self.handles[source].leave.remote(member)
        finally:
            self.leaving.end(member)
        await self._apply(update)
        if name is not None:
            self._later_regroup(name)
            self._later_compact(name)

    async def member_out(self, name: str, member: str, reason: str, error: BaseException | None = None) -> None:
        """Bucket ``name`` says ``member`` no longer needs its slot: it
        ``"finished"`` (its results still drain from the bucket), or ``"failed"``
        (with ``error``) or was ``"reaped"``. The slot goes to a waiting member."""
        if self.seats.home(member) not in (None, name) and (
                self.placement is None or self.placement.bucket_of(member) != name):
            return  # it moved on (regrouping): a bucket it left says nothing of it
        self.seats.out(member, reason)
        if reason == "reaped":
            self.history.note(name, reason, member)
        if self.placement is None or self.placement.bucket_of(member) != name:
            return  # its trial left (``_forget``): no one will ask for it
        if reason == "failed" and error is not None:
            # Kept for its trial, which may not have asked yet: ChorusSearch seats
            # members ahead of their trials, and in a bucket already running one
            # can fail before Tune starts its trial. Asking then, the trial found
            # the member nowhere and failed with an error that said nothing of it.
            self._unplaced[member] = error
        await self._apply(self.placement.remove(member))
        self._later_regroup(name)
        self._later_compact(name)

    def _later_compact(self, name: str) -> None:
        # Later, not now: a bucket must not shrink under the member that refills it.
        asyncio.get_running_loop().create_task(self._maybe_compact(name, compact_after_s(self.placement, name)))

    async def _maybe_compact(self, name: str, delay_s: float = 0.0, tries: int = _COMPACT_TRIES) -> None:
        await asyncio.sleep(delay_s)
        record = self.placement.buckets.get(name) if self.placement is not None else None
        if record is not None and compaction_due(self.placement, name):
            # Emptied into the other buckets of its key, it closes instead; and
            # a compacted bucket has no free slot left for others' survivors.
            await self._regroup(record.key)
        handle = self.handles.get(name)
        if handle is None or not compaction_due(self.placement, name):
            return
        # The bucket offers no slot while it compacts (placement.py): placed in
        # one that the compaction removed, a member could not join.
        before = self.placement.buckets[name].capacity
        expected = self.placement.begin_compaction(name)
        capacity = None
        try:
            capacity = await handle.compact.remote(expected)
        except RayActorError:
            pass
        finally:
            update = self.placement.end_compaction(name, capacity)
        if capacity is not None and capacity != before and name in self.placement.buckets:
            logger.info("pool: bucket %s compacted to %d", name, capacity)
            self.history.compacted(name, capacity)
        await self._apply(update)
        if capacity is None and tries > 1 and name in self.handles:
            # Refused: a leave or join is still on its way to it. Looked at again shortly.
            asyncio.get_running_loop().create_task(
                self._maybe_compact(name, compact_after_s(self.placement, name), tries - 1))

    # ----- regrouping: survivors move together (regrouping.py, docs/design.md D3) ------------------
    def _later_regroup(self, name: str) -> None:
        record = self.placement.buckets.get(name) if self.placement is not None else None
        if record is not None and record.key.options.regroup:
            asyncio.get_running_loop().create_task(self._regroup(record.key))

    async def _reap_solo_loop(self) -> None:
        """A solo member's trial trains it (rules/solo.py), so no bucket watches
        that trial's actor: the pool does. A member whose trial actor died
        leaves, and its place in the budget frees (else the members waiting for
        a bucket would wait for it for good)."""
        while True:
            await asyncio.sleep(_SOLO_REAP_S)
            try:
                watched = {member: self.clients[member] for name in list(self._solo)
                           for member in (self.placement.buckets[name].members if self.placement is not None
                                          and name in self.placement.buckets else ())
                           if self.clients.get(member) is not None}
                if not watched:
                    continue
                dead = await asyncio.to_thread(dead_among, set(watched.values()))
                for member, client in watched.items():
                    if client in dead and self.clients.get(member) == client:
                        logger.info("pool: solo member %s left: the trial actor training it is gone", member)
                        await self.leave(member, reason="reaped")
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                logger.exception("pool: solo reaper")

    async def _regroup_loop(self) -> None:
        while True:
            await asyncio.sleep(_REGROUP_POLL_S)
            if self.placement is None:
                continue
            counts: dict[GroupKey, int] = {}
            for record in self.placement.buckets.values():
                if record.members and record.key.options.regroup:
                    counts[record.key] = counts.get(record.key, 0) + 1
            for key, buckets in counts.items():
                if buckets > 1:
                    await self._regroup(key)

    async def _regroup(self, key: GroupKey) -> None:
        """Empty sparse buckets of ``key`` into the others (one regrouping per key at a time)."""
        if not key.options.regroup:
            return
        if key in self._regrouping:
            self._regroup_again.add(key)  # looked at again once the one running ends
            return
        self._regrouping.add(key)
        try:
            while True:
                self._regroup_again.discard(key)
                for move in await self._plan_regroup(key):
                    if not await self._move(move):
                        break  # something changed under it: the next look decides afresh
                if key not in self._regroup_again:
                    return
        except Exception:  # noqa: BLE001 - a regrouping that fails leaves every member where it was
            logger.exception("pool: regrouping %s", key.model_name)
        finally:
            self._regrouping.discard(key)

    async def _plan_regroup(self, key: GroupKey) -> list[Move]:
        if self.placement is None or self.placement.waiting_for(key):
            return []
        names = [n for n, r in self.placement.buckets.items()
                 if r.key == key and r.members and n in self.handles and self.history.has_started(n)]
        if len(names) < 2:
            return []

        async def view(name: str):
            try:
                return await asyncio.wait_for(asyncio.wrap_future(self.handles[name].regroup_view.remote().future()),
                                              10.0)
            except Exception:  # noqa: BLE001 - busy or dead: it takes no part this time
                return None

        views, draining = [], set()
        for name, seen in zip(names, await asyncio.gather(*(view(n) for n in names))):
            record = self.placement.buckets.get(name)
            if seen is None or record is None:
                continue
            draining.update(seen["draining"])
            holds = {m.member for m in seen["members"]} | set(seen["pending"])
            # As compaction requires: its book holds exactly the members the pool holds there.
            ready = not record.busy and holds == set(record.members) and seen["capacity"] == record.capacity
            views.append(BucketView(name, record.capacity, tuple(seen["members"]), len(seen["pending"]), ready,
                                    self.history.place_of(name)))
        for member, source in list(self._draining.items()):
            if source in names and member not in draining:
                del self._draining[member]  # its trial read what it left there
        return plan_regroup(views, self.placement.waiting_for(key), draining | set(self._draining))

    async def _move(self, move: Move) -> bool:
        """Move ``move``'s members: the destination holds their slots, the
        source takes them out between iterations (their queued results stay
        there for their trials), the destination builds them from their
        states. Whether they moved; a refusal anywhere leaves every member where it was."""
        source, dest = move.source, move.dest
        held = self.placement.begin_move(source, dest)
        if held is None:
            return False
        expected_source, expected_dest = held
        members = list(move.members)
        items, housed, held_slots = None, [], False
        src, dst = self.handles.get(source), self.handles.get(dest)
        try:
            if src is None or dst is None or not await dst.reserve_moved.remote(members, expected_dest):
                return False
            held_slots = True  # until move_in: the destination trains nobody while it holds them
            tokens = {}
            for unit in move.units:
                self._tokens += 1
                tokens.update(dict.fromkeys(unit.members, unit.carries(f"{source}/{self._tokens}")))
            items = await src.take_out.remote(tokens, expected_source, dest)
            if items is None:
                return False
            # A member whose trial left meanwhile stays behind (its old bucket was told).
            gone = [m for m in members if self.placement.bucket_of(m) != source]
            items = [item for item in items if item["member"] not in gone]
            # A KeyError if either closed meanwhile: only a bucket that died does.
            self.placement.move([item["member"] for item in items], source, dest)
            await dst.move_in.remote(items)
            held_slots = False
            if gone:
                await dst.cancel_moved.remote(gone)
            for item in items:
                if self.placement.bucket_of(item["member"]) != dest:
                    # It left while its new bucket was told (its leave went to the old one).
                    with contextlib.suppress(RayActorError):
                        await dst.leave.remote(item["member"], keep_state=False)
                    continue
                self.seats.house(item["member"], dest)
                housed.append(item["member"])
                if item["queued"]:
                    self._draining[item["member"]] = source
                client = self.clients.get(item["member"])
                if client is not None and item["client"] is None:
                    dst.watch.remote(item["member"], client)  # bound to its trial while it moved
        except (RayActorError, KeyError) as exc:
            # A bucket died (its death watch cleans up). Members taken out whose
            # new bucket died are lost with it, as its own members are.
            logger.warning("pool: moving %s from bucket %s to %s failed: %s", members, source, dest, exc)
            for item in items or ():
                if self.seats.home(item["member"]) != dest:
                    self._unplaced[item["member"]] = RuntimeError(
                        f"member {item['member']} was lost moving from bucket {source} to {dest}: {exc}")
            return False
        finally:
            if held_slots:
                # Refused, or it failed half way: the destination lets the slots go
                # (a member move_in reached is built, not let go).
                with contextlib.suppress(RayActorError):
                    await dst.cancel_moved.remote(members)
            update = self.placement.end_move(source, dest)
            await self._apply(update)
        self._events += 1
        if not housed:
            return False
        self.history.regrouped(source, dest, housed)
        record = self.placement.buckets.get(dest)
        logger.info("pool: regrouped %s from bucket %s to bucket %s (%d of %d slots held there now)", housed,
                    source, dest, len(record.members) if record else 0, record.capacity if record else 0)
        if self.placement.buckets.get(source) is not None and self.placement.buckets[source].members:
            self._later_compact(source)
        return True

    async def moved_to(self, member: str, source: str, timeout_s: float = 60.0):
        """``(bucket name, handle)`` where ``member`` trains now, once it moved out of bucket ``source``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if member in self._unplaced:
                raise self._unplaced[member]
            name = self.seats.home(member)
            if name is not None and name != source and name in self.handles:
                return name, self.handles[name]
            if name is None or asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"member {member} moved out of bucket {source}, and the pool holds it nowhere")
            await asyncio.sleep(0.02)  # the move is still on its way (its new bucket is building it)

    async def bucket_failed(self, name: str) -> None:
        """A trainable saw bucket ``name`` die: forget it now (its death watch may be later)."""
        await self._bucket_gone(name, died=True)

    async def _apply(self, update: Update) -> None:
        self._events += 1
        for name in update.closed:
            asyncio.get_running_loop().create_task(self._close_when_drained(name))
        self._realize_all(update.placed)
        for name in update.idle:
            asyncio.get_running_loop().create_task(self._close_if_idle(name))

    async def close_idle(self) -> list[str]:
        """Close every idle bucket (no member in its slots) now rather than its
        ``idle_close_s`` later; each still closes only once its trials have
        read every result. Their names."""
        if self.placement is None:
            return []
        names = [name for name, record in self.placement.buckets.items() if not record.members]
        for name in names:
            _, update = self.placement.close(name)
            await self._apply(update)
            asyncio.get_running_loop().create_task(self._close_when_drained(name))
        if names:
            self._share_cores()
        return names

    async def _close_if_idle(self, name: str) -> None:
        # It stays in the placement until its members' trials read every result (see closing.py).
        delay_s = idle_close_s(self.placement, name)
        if delay_s is None:
            return
        if name in self._solo:
            delay_s = 0.0  # a solo member's place takes no other member

        await asyncio.sleep(delay_s)
        if not self._idle.start(name):
            return
        try:
            while True:
                if not stays_idle(self.placement, name):
                    return
                if await self._drained(name):
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
        finally:
            self._idle.end(name)
        _, update = self.placement.close(name)
        await self._apply(update)
        self._share_cores()
        await self._close_when_drained(name)

    async def _drained(self, name: str) -> bool:
        handle = self.handles.get(name)
        if handle is None:
            return True
        try:
            return await handle.drained.remote()
        except RayActorError:
            return True

    async def _close_when_drained(self, name: str) -> None:
        # A bucket whose slots are empty may still hold results its members'
        # trials have not read: it closes once they have.
        if not self._closing.start(name):
            return
        try:
            while name in self.handles:
                try:
                    if await self.handles[name].drained.remote():
                        break
                except RayActorError:
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
            await self._close_actor(name)
        finally:
            self._closing.end(name)

    def _share_cores(self) -> None:
        """On a CPU-only machine with default bucket resources, the open buckets
        share every core: a lone bucket (one bucket of 32, say) then uses both
        cores of a 2-core machine instead of idling one. Buckets given explicit
        resources keep the threads their CPU share says."""
        if ray.cluster_resources().get("GPU", 0) > 0:
            return
        shared = [n for n, h in self.handles.items() if n in self.placement.buckets
                  and self.placement.buckets[n].key.options.resources_per_bucket is None]
        if not shared:
            return
        # Per node: a bucket shares the cores of the node it runs on, not the cluster's.
        nodes = {name: self.history.node_of(name) for name in shared}
        for name, threads in shared_threads(node_cpus(), nodes).items():
            self.handles[name].set_threads.remote(threads)

    async def bucket_started(self, name: str, where: dict) -> None:
        """Bucket ``name`` runs: ``where`` holds its ``node_id``, ``device``,
        ``requested_device`` and ``gpu_ids``. Kept in its history, so the stats
        say where a bucket ran after it closed or died with its node."""
        self._events += 1
        self.history.started(name, where, at=time.monotonic())
        if name in self.handles:
            self._share_cores()

    async def _close_actor(self, name: str) -> None:
        handle = self.handles.pop(name, None)
        self.history.closed(name)
        if handle is None:
            return
        try:
            await handle.close.remote()
        except RayActorError:
            pass
        ray.kill(handle)

    async def _watch_bucket(self, name: str, handle) -> None:
        try:
            await handle.wait_closed.remote()
        except RayActorError as exc:
            if self.handles.get(name) is handle:
                logger.warning("pool: bucket %s died: %s", name, exc)
                await self._bucket_gone(name, died=True)

    async def _bucket_gone(self, name: str, died: bool) -> None:
        self._events += 1
        self.handles.pop(name, None)
        self._stops.forget(name)
        for member, source in list(self._draining.items()):
            if source == name:
                del self._draining[member]  # its unread results died there (its trial hears it)
        lost = self.seats.bucket_lost(name)
        self.history.gone(name, died, lost)
        if self.placement is None or name not in self.placement.buckets:
            return
        # A bucket dies with its node, and the node's resources go with it: the
        # budget must not open buckets the cluster no longer holds.
        self.placement.max_buckets = self._budget(self.placement.buckets[name].key.options)
        _, update = self.placement.close(name)
        logger.warning("pool: bucket %s lost with members %s; budget now %s buckets; placed %s", name, lost,
                       self.placement.max_buckets, [(p.trial_id, p.bucket) for p in update.placed])
        await self._apply(update)
        self._share_cores()

    async def _watch_job(self) -> None:
        # Detached, so nothing else ends the pool: it ends with the job that made it.
        while True:
            await asyncio.sleep(_JOB_POLL_S)
            try:
                jobs = ray._private.state.jobs()  # the GCS job table; no dashboard needed
                dead = any(j.get("JobID") == self.job_id and j.get("IsDead") for j in jobs)
            except Exception:  # noqa: BLE001
                continue
            if dead:
                await self.shutdown()
                ray.actor.exit_actor()

    # ----- inspection -----------------------------------------------------------------------------
    async def wait_status(self, member: str) -> dict[str, Any]:
        """For the trial of ``member``, waiting for its bucket: ``waits_for``
        (what it waits for, in words, for the error if the wait stalls),
        ``progress`` (changes whenever anything in the sweep moves: the pool's
        events and its buckets' iterations) and ``hopeless`` (the wait can
        never end: its bucket claims resources that no alive node has)."""
        wait = what_it_waits_for(member, self.seats.home(member), self.placement, self.scouts.is_held(member))
        if wait.key is not None:  # it waits for a slot: idle members of full buckets give theirs up
            await self._evict_idle(wait.key)
        waits_for, hopeless = word_wait(member, wait, self.placement, self.handles, self._bucket_resources,
                                        _alive_nodes, self.scouts.wait_s)
        return {"waits_for": waits_for, "progress": self._events + await self._iterations(), "hopeless": hopeless}

    async def _evict_idle(self, key: GroupKey) -> None:
        """Members of ``key`` wait for a slot: full buckets of ``key`` give up the
        slots of members whose trials stopped asking (see ``waits.EVICT_IDLE_S``);
        so do buckets of other keys when the budget is used up (emptied, one
        closes and its budget opens a bucket of ``key``)."""
        budget_used = not self.placement.can_open()
        for name, record in list(self.placement.buckets.items()):
            handle = self.handles.get(name)
            if handle is None or not self.history.has_started(name):
                continue  # not started: nobody in it has read anything
            if not asks_to_evict(record.free, record.key == key, budget_used):
                continue
            try:
                evicted = await handle.evict_idle.remote(EVICT_IDLE_S)
            except RayActorError:
                continue
            for member in evicted:
                self.seats.evicted(member, name)
                if self.placement.bucket_of(member) == name:
                    await self._apply(self.placement.remove(member))

    async def _iterations(self) -> int:
        """Iterations run by the buckets that started (one that does not answer in time counts 0)."""
        started = [h for n, h in self.handles.items() if self.history.has_started(n)]

        async def one(handle) -> int:
            try:
                return await asyncio.wait_for(asyncio.wrap_future(handle.progress.remote().future()), 5.0)
            except Exception:  # noqa: BLE001 - busy, or dead (its death watch tells)
                return 0

        return sum(await asyncio.gather(*(one(h) for h in started)))

    async def bucket_of(self, member: str):
        """``(bucket name, handle)`` of the bucket holding ``member`` (a member
        or a trial id), or ``None``."""
        name = self._read_from(self.readers.member_of(member))
        return None if name is None else (name, self.handles.get(name))

    def _read_from(self, member: str) -> str | None:
        """The bucket ``member``'s trial reads next: the one it moved out of
        while results it left there wait (regrouping), else its home."""
        source = self._draining.get(member)
        return source if source in self.handles else self.seats.home(member)

    async def free_slots(self, structural_key: Hashable) -> int:
        """Free slots in open buckets whose sharing key (``chorus_tune.stack.sharing_key``) is ``structural_key``."""
        if self.placement is None:
            return 0
        return sum(r.free for r in self.placement.buckets.values() if r.key.structural_key == structural_key)

    async def stats(self) -> dict[str, dict]:
        """Every bucket this pool opened: model, bucket_size, capacity (less after
        compaction), the members it trained (``trials``), its current members,
        whether it closed, died or reaped members; once it started, where it
        runs (``node_id``, ``device``, ``requested_device``, ``gpu_ids``); and,
        read while it is open, wasted member-iterations, iterations and route."""
        out = {}
        for name in self.history.names():  # a copy: a bucket may open while this awaits each one
            record = self.placement.buckets.get(name) if self.placement else None
            members = list(record.members) if record else []
            handle, live = self.handles.get(name), None
            # Only a bucket that started answers: one waiting for resources
            # (a GPU another bucket holds) would hold up the stats until then.
            if handle is not None and self.history.has_started(name):
                try:
                    live = await handle.describe.remote()
                except RayActorError:
                    pass
            out[name] = self.history.report(name, members, live)
        return out

    async def shutdown(self) -> None:
        for name in list(self.handles):
            await self._close_actor(name)


def _log_split(key: GroupKey, other: GroupKey | None) -> None:
    """Say why a new structure of a model already seen (``other``) gets buckets
    of its own (docs/design.md D9): say, members whose activation differs."""
    if other is None:
        return
    from chorus_tune.stack import describe_split

    logger.info("pool: %s members of another structure get buckets of their own: %s", key.model_name,
                describe_split(other.structural_key, key.structural_key))


def _alive_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def _log_size(key: GroupKey, done: asyncio.Future) -> None:
    if done.exception() is None:
        fit = done.result()
        logger.info("pool: bucket size %d for %s (%s: %s)", fit.k, key.model_name, fit.source, fit.reason)


def _preload_torch() -> None:
    try:
        import chorus_tune.task  # noqa: F401  (imports torch)
    except Exception:  # noqa: BLE001 - only a head start: the real import reports any error
        pass


PoolActor = ray.remote(ChorusPool)
