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
import logging
import threading
from typing import Any

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import RayActorError

from chorus_tune.tune.actors.pool_buckets import BucketLifecycle
from chorus_tune.tune.actors.pool_inspection import Inspection
from chorus_tune.tune.actors.pool_leaving import Departures
from chorus_tune.tune.actors.pool_regroup import Regrouping
from chorus_tune.tune.actors.pool_seating import Seating
from chorus_tune.tune.actors.shared_data import DataCopies
from chorus_tune.tune.actors.sizing import fit_summary, measure_bucket_size
from chorus_tune.tune.observe.actor_log import log_to_actor_stdout
from chorus_tune.tune.rules.actor_reuse import ActorReuse
from chorus_tune.tune.rules.bucket_history import BucketHistory
from chorus_tune.tune.rules.closing import Watches
from chorus_tune.tune.rules.fusion_verdicts import FusionVerdicts
from chorus_tune.tune.rules.grouping import GroupKey, split_from, width_device
from chorus_tune.tune.rules.leaving import Leaving
from chorus_tune.tune.rules.placement import Placed, Placement, Update
from chorus_tune.tune.rules.readers import Readers
from chorus_tune.tune.rules.resources import bucket_budget, bucket_resources, spare_buckets
from chorus_tune.tune.rules.run_stops import RunStops
from chorus_tune.tune.rules.scouts import Scouts
from chorus_tune.tune.rules.seat_book import SeatBook
from chorus_tune.tune.rules.shared_data import pool_preloads
from chorus_tune.tune.rules.solo import is_solo_key
from chorus_tune.tune.values.options import BucketOptions, RungSchedule
from chorus_tune.tune.values.protocol import NAMESPACE, bucket_prefix

logger = logging.getLogger(__name__)

_JOB_POLL_S = 2.0


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


class ChorusPool(Seating, BucketLifecycle, Departures, Regrouping, Inspection):
    """Maps members to buckets, trials to members; creates, watches and closes buckets.

    A *member* is what a bucket trains. A trial reads one member: the member
    ChorusSearch seated for it before Tune created it (:meth:`seat`, then
    :meth:`bind`), or one of its own, named by its trial id and built on its
    first request (:meth:`reserve`).

    This class holds the pool's state and what every part needs (a member's
    structural key, bucket sizes, budgets, the placement's answers); each job
    is a part of its own module, on the state this ``__init__`` sets:
    :class:`~.pool_seating.Seating` (members in),
    :class:`~.pool_buckets.BucketLifecycle` (bucket actors opened, watched, closed),
    :class:`~.pool_leaving.Departures` (members out),
    :class:`~.pool_regroup.Regrouping` (survivors moved, buckets compacted) and
    :class:`~.pool_inspection.Inspection` (waits, where members are, stats).
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
        # Each task's loaded data, one copy for the sweep's processes (shared_data.py).
        self.data = DataCopies()
        self.handles: dict[str, Any] = {}
        self._threads_sent: dict[str, int] = {}  # bucket -> the threads it was last told to use (_share_cores)
        self._training_shared: frozenset = frozenset()  # the buckets with members when cores were last shared
        # Every group key seen, to itself. Read its fields by name (key.options);
        # the map only keeps index reads of older code working.
        self.key_info: dict[GroupKey, GroupKey] = {}
        self.clients: dict[str, str | None] = {}  # trial or member -> its trial actor's id (liveness.py)
        self.history = BucketHistory()
        self.fusion = FusionVerdicts()  # structures measured to gain too little fused train solo
        # members sent solo for that, not yet read -> (key, bucket size): back to buckets where
        # Tune starts a process per trial (Seating._back_to_buckets)
        self.solo_for_gain: dict[str, tuple[GroupKey, int]] = {}
        self.seats = SeatBook()  # seated members, those that cannot be built, and each member's home bucket
        self.readers = Readers()  # trial id -> the member it reads (or the seated one it is bound to)
        self.actor_reuse = ActorReuse()  # whether Tune starts a process for every trial (said once a run)
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
        self._regroup_views: dict[GroupKey, list] = {}  # each key's buckets at its last regrouping look
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
            if pool_preloads(ray.cluster_resources()):
                self.data.preload(task_id_, self.tasks[task_id_], task_blob)
        return True

    async def learn_task(self, task_id_: str, task_blob: bytes) -> None:
        """ChorusSearch teaches the task as Tune sets the run up, before its
        first seat: on a machine without GPUs the pool starts loading its data
        now (``DataCopies.preload``), which the first seat would wait for."""
        self._learn_task(task_id_, task_blob)

    async def input_row(self, task_id_: str, task_blob: bytes) -> Any:
        """The first input row of the task's data, from the pool's own load of
        it (waited for), or ``None`` where the pool loads none: what the
        driver's split report prices padding with, not loading the data again."""
        self._learn_task(task_id_, task_blob)
        return await self.data.input_row_when_loaded(task_id_)

    async def shared_data(self, task_id_: str, node: str) -> list:
        """The copy of the task's loaded data made on ``node``: ``[ref]``, or ``[]`` when there is none (yet)."""
        return await self.data.get(task_id_, node)

    async def offer_data(self, task_id_: str, node: str, refs: list) -> None:
        """Keep a copy of the task's loaded data a process on ``node`` offers (``[ref]``); the first is kept."""
        await self.data.offer(task_id_, node, refs)

    def _key(self, task_id_: str, options: BucketOptions, config: dict) -> GroupKey:
        if self.placement is None:
            self.placement = Placement(prefix=bucket_prefix(self.job_id, self.generation))
        # Set on every key: successive runs in one driver may size their buckets differently.
        resources = self._size_budget(options)
        task = self.tasks[task_id_]
        from chorus_tune.stack import sharing_key
        from chorus_tune.width_rule import WidthGroups
        from chorus_tune.widths import PaddingPrices

        # Widths pad: trials whose widths the width rule lets pad together share buckets
        # (docs/design.md D9), grouped in the order they come, priced by multiply-adds as
        # a bucket prices them (the task's data is loaded here once, for one input row,
        # when a structure's widths first differ). Raises the factory's own error for a
        # bad config.
        device = width_device(resources)
        prices = self._prices.setdefault(task_id_, PaddingPrices(lambda: self._input_row(task_id_)))
        skey = sharing_key(task, config, self._width_groups.setdefault(device, WidthGroups(device_type=device)),
                           prices)
        # The class's name read off the key (its model_class is module.qualname): the model
        # was built on meta once, for the key, not again for its name.
        key = GroupKey(task_id_, options, skey.model_class.rsplit(".", 1)[-1], skey)
        if key not in self.key_info:
            _log_split(key, split_from(key, self.key_info))
        self.key_info.setdefault(key, key)
        return key

    def _input_row(self, task_id_: str) -> Any:
        """The row padding is priced with: from the pool's load of the data, else loaded for it."""
        row = self.data.input_row(task_id_)
        return row if row is not None else self.tasks[task_id_].input_row()

    def _is_solo(self, name: str) -> bool:
        """Whether ``name`` is a solo member's place in the budget, not a bucket (rules/solo.py)."""
        record = self.placement.buckets.get(name) if self.placement is not None else None
        return record is not None and is_solo_key(record.key)

    def _key_in_pool(self, key: GroupKey) -> bool:
        """Whether a member of ``key`` is seated, waiting or in a bucket already (a solo member's key is its own)."""
        if self.placement is None:
            return False
        return (any(record.key == key for record in self.placement.buckets.values())
                or self.placement.waiting_for(key) > 0)

    def _request(self, member: str, key: GroupKey, size: int) -> Placed | None:
        """The placement's answer for ``member``; an empty bucket of another key
        whose budget it took closes once its trials have read every result."""
        placed = self.placement.request(member, key, size)
        for empty in placed.replaces if placed is not None else ():
            logger.info("pool: %s takes the budget of idle bucket %s", member, empty)
            asyncio.get_running_loop().create_task(self._close_when_drained(empty))
        return placed

    def _size_budget(self, options: BucketOptions) -> dict[str, float]:
        """Set the placement's budget and spare (rules/resources.py) for buckets
        of ``options``, from the cluster now; returns what one such bucket claims.
        The cluster is read once: this runs for every member seated (a GCS call,
        about 0.4 ms from an actor, was made four times a member here)."""
        cluster = ray.cluster_resources()
        per_bucket = bucket_resources(options.resources_per_bucket, cluster)
        capped = options.max_buckets is not None
        self.placement.max_buckets = options.max_buckets if capped else bucket_budget(cluster, per_bucket)
        self.placement.spare = spare_buckets(per_bucket, capped=capped)
        return per_bucket

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

    async def _apply(self, update: Update) -> None:
        self._events += 1
        for name in update.closed:
            asyncio.get_running_loop().create_task(self._close_when_drained(name))
        self._realize_all(update.placed)
        for name in update.idle:
            asyncio.get_running_loop().create_task(self._close_if_idle(name))
        if update.idle or update.placed:
            self._share_cores_if_training_changed()  # the cores go to the buckets with members to train

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

    def _read_from(self, member: str) -> str | None:
        """The bucket ``member``'s trial reads next: the one it moved out of
        while results it left there wait (regrouping), else its home."""
        source = self._draining.get(member)
        return source if source in self.handles else self.seats.home(member)





def _log_split(key: GroupKey, other: GroupKey | None) -> None:
    """Say why a new structure of a model already seen (``other``) gets buckets
    of its own (docs/design.md D9): say, members whose activation differs."""
    if other is None:
        return
    from chorus_tune.stack import describe_split

    logger.info("pool: %s members of another structure get buckets of their own: %s", key.model_name,
                describe_split(other.structural_key, key.structural_key))




def _log_size(key: GroupKey, done: asyncio.Future) -> None:
    if done.exception() is None:
        fit = done.result()
        logger.info("pool: bucket size %d for %s (%s: %s)", fit.k, key.model_name, fit.source, fit.reason)


def _preload_torch() -> None:
    try:
        import chorus_tune.task  # noqa: F401  (imports torch)

        if pool_preloads(ray.cluster_resources()):
            # Where the pool measures what fusing gains (rules/fusion_verdicts.py), its first
            # unfused step would import torch._dynamo on the first seat's path (about 1 s).
            from chorus_tune.unfused import warm_torch_optim

            warm_torch_optim()
    except Exception:  # noqa: BLE001 - only a head start: the real import reports any error
        pass


PoolActor = ray.remote(ChorusPool)
