"""The pool: one named actor per Tune run that places trials into buckets (DESIGN D2).

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
there would die with that trial.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Hashable

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import RayActorError

from .grouping import should_compact
from .options import BucketOptions
from .placement import Placed, Placement, Update
from .resources import bucket_actor_options, bucket_budget, default_bucket_resources

logger = logging.getLogger(__name__)

NAMESPACE = "chorus_tune"
NEED_TASK = "chorus/need-task"
QUEUED = "chorus/queued"
_JOB_POLL_S = 2.0


def pool_name(job_id: str | None = None) -> str:
    """The pool's actor name for ``job_id`` (default: the calling process's job)."""
    return f"chorus-pool-{job_id or ray.get_runtime_context().get_job_id()}"


def task_id(task_blob: bytes) -> str:
    return hashlib.sha256(task_blob).hexdigest()[:16]


class ChorusPool:
    """Maps ``trial_id -> (bucket, slot)``; creates, watches and closes buckets."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.placement: Placement | None = None
        self.tasks: dict[str, Any] = {}
        self.blobs: dict[str, bytes] = {}
        self.handles: dict[str, Any] = {}
        self.key_info: dict[Hashable, tuple[str, BucketOptions, str, Hashable]] = {}
        self.clients: dict[str, Any] = {}
        self.history: dict[str, dict] = {}
        self._waiting: dict[str, asyncio.Future] = {}
        self.announced: dict[Hashable, int] = {}  # structural key -> trials a searcher holds back
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._started = True
            asyncio.get_running_loop().create_task(self._watch_job())

    # ----- trials in ------------------------------------------------------------------------------
    async def reserve(self, trial_id: str, task_id_: str, task_blob: bytes | None, config: dict,
                      options: BucketOptions, client: Any = None):
        """Place ``trial_id`` into a bucket of its structural key and reserve it a
        slot there; returns ``(bucket name, bucket handle)``, or ``NEED_TASK``
        when the pool has not seen this task yet (call again with its bytes),
        or ``QUEUED`` while every bucket of its key is full and no new one fits
        (then :meth:`await_placement`). Never waits for a slot: Tune calls this
        from ``setup``/``reset_config``, and a trial blocked there holds Tune's
        actor bookkeeping (a cached actor that would free the slot is only
        released once the blocked trial starts). Raises what the model factory
        raises for ``config``."""
        self._start()
        if task_id_ not in self.tasks:
            if task_blob is None:
                return NEED_TASK
            self.tasks[task_id_] = cloudpickle.loads(task_blob)
            self.blobs[task_id_] = task_blob
        if self.placement is None:
            self.placement = Placement(self._budget(options), prefix=f"chorus-bucket-{self.job_id}")
        else:
            # Successive runs in one driver may size their buckets differently.
            self.placement.max_buckets = self._budget(options)
        # A reservation for a trial already placed is a restart (new actor,
        # reset, recovery): its old membership is stale.
        if self.placement.bucket_of(trial_id) is not None or self.placement.is_waiting(trial_id):
            await self.leave(trial_id)
        task = self.tasks[task_id_]
        skey = task.structural_key(config)  # raises the factory's own error for a bad config
        key = (task_id_, options, skey)
        if key not in self.key_info:
            self.key_info[key] = (task_id_, options, self._model_name(task, config), skey)
        self.clients[trial_id] = client
        placed = self.placement.request(trial_id, key, options.bucket_size)
        if placed is None:
            self._waiting[trial_id] = asyncio.get_running_loop().create_future()
            logger.info("pool: %s waits for a bucket (all %s in use)", trial_id, self.placement.max_buckets)
            return QUEUED
        name = await self._realize(placed)
        return name, self.handles[name]

    async def await_placement(self, trial_id: str):
        """``(bucket name, handle)`` of a ``QUEUED`` trial, once it has a slot."""
        future = self._waiting.get(trial_id)
        if future is None:
            name = None if self.placement is None else self.placement.bucket_of(trial_id)
            if name is None or name not in self.handles:
                raise RuntimeError(f"trial {trial_id} is neither placed nor waiting for a bucket")
            return name, self.handles[name]
        name = await future
        return name, self.handles[name]

    async def _realize_waiting(self, placed: Placed) -> None:
        # The future stays findable until the bucket expects the trial.
        future = self._waiting.get(placed.trial_id)
        try:
            name = await self._realize(placed)
        except Exception as exc:  # noqa: BLE001 - the waiting trial hears of it
            if future is not None and not future.done():
                future.set_exception(exc)
        else:
            if future is not None and not future.done():
                future.set_result(name)
        if self._waiting.get(placed.trial_id) is future:
            self._waiting.pop(placed.trial_id, None)

    async def _realize(self, placed: Placed) -> str:
        """Make a placement real: create the bucket actor if new, and have it expect the trial."""
        name = placed.bucket
        if placed.opened or name not in self.handles:
            record = self.placement.buckets[name]
            tid, options, model_name, _ = self.key_info[record.key]
            resources = dict(options.resources_per_bucket or default_bucket_resources(ray.cluster_resources()))
            bucket_options = BucketOptions(**{**options.__dict__,
                                              "resources_per_bucket": BucketOptions.resources(resources)})
            from .bucket_actor import BucketActor

            handle = BucketActor.options(
                name=name, namespace=NAMESPACE, scheduling_strategy="DEFAULT", max_restarts=0,
                **bucket_actor_options(resources),
            ).remote(name, self.blobs[tid], bucket_options, model_name, ray.get_runtime_context().current_actor)
            self.handles[name] = handle
            self.history[name] = {"model": model_name, "bucket_size": record.capacity,
                                  "capacity": record.capacity, "trials": record.ever,
                                  "closed": False, "reaped": []}
            asyncio.get_running_loop().create_task(self._watch_bucket(name, handle))
        await self.handles[name].expect.remote(placed.trial_id, self.clients.get(placed.trial_id))
        return name

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
        cluster = ray.cluster_resources()
        resources = dict(options.resources_per_bucket or default_bucket_resources(cluster))
        return bucket_budget(cluster, resources)

    # ----- trials out -----------------------------------------------------------------------------
    async def leave(self, trial_id: str, notify_bucket: bool = True, reason: str | None = None) -> None:
        """``trial_id`` leaves its bucket (or stops waiting). Idempotent; a no-op
        for a trial the pool never saw. ``reason`` (e.g. ``"reaped"``) is recorded
        in the bucket's history."""
        self._start()
        if self.placement is None:
            return
        future = self._waiting.pop(trial_id, None)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"trial {trial_id} left before it was placed"))
        name = self.placement.bucket_of(trial_id)
        self.clients.pop(trial_id, None)
        if reason is not None and name in self.history:
            self.history[name].setdefault(reason, []).append(trial_id)
        update = self.placement.remove(trial_id)
        if name is not None and notify_bucket and name in self.handles:
            try:
                await self.handles[name].leave.remote(trial_id)
            except RayActorError:
                pass  # the bucket died: its death watch cleans up
        await self._apply(update)
        if name is not None:
            # Later, not now: a reset_config leaves and rejoins at once, and a
            # bucket must not shrink under the trial that refills it.
            record = self.placement.buckets.get(name)
            delay = self.key_info[record.key][1].compact_after_s if record is not None else 0.0
            asyncio.get_running_loop().create_task(self._maybe_compact(name, delay))

    async def set_waiting(self, counts: dict) -> None:
        """How many trials of each structural key a searcher holds back (ChorusSearch):
        a bucket that one of them would refill is not compacted."""
        drained = {k for k, n in self.announced.items() if n > 0 and counts.get(k, 0) <= 0}
        self.announced = dict(counts)
        # A bucket whose last leaver found trials still waiting was left as it
        # was; once none wait, nothing else would ever look at it again.
        if drained and self.placement is not None:
            for name, record in list(self.placement.buckets.items()):
                if record.key[2] in drained:
                    delay = record.key[1].compact_after_s
                    asyncio.get_running_loop().create_task(self._maybe_compact(name, delay))

    async def _maybe_compact(self, name: str, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        record = self.placement.buckets.get(name) if self.placement else None
        handle = self.handles.get(name)
        if record is None or handle is None:
            return
        if not record.key[1].compact:
            return
        skey = record.key[2]
        waiting = self.announced.get(skey, 0) + self.placement.waiting_for(record.key)
        if not should_compact(record.capacity, len(record.members), waiting):
            return
        try:
            capacity = await handle.compact.remote()
        except RayActorError:
            return
        if capacity is not None and name in self.placement.buckets:
            self.placement.buckets[name].capacity = capacity
            self.history[name]["capacity"] = capacity
            self.history[name]["compactions"] = self.history[name].get("compactions", 0) + 1

    async def bucket_failed(self, name: str) -> None:
        """A trainable saw bucket ``name`` die: forget it now (its death watch may be later)."""
        await self._bucket_gone(name, died=True)

    async def _apply(self, update: Update) -> None:
        for name in update.closed:
            await self._close_actor(name)
        for placed in update.placed:
            asyncio.get_running_loop().create_task(self._realize_waiting(placed))
        for name in update.idle:
            asyncio.get_running_loop().create_task(self._close_if_idle(name))

    async def _close_if_idle(self, name: str) -> None:
        record = self.placement.buckets.get(name)
        if record is None:
            return
        await asyncio.sleep(self.key_info[record.key][1].idle_close_s)
        record = self.placement.buckets.get(name)
        if record is not None and not record.members:
            _, update = self.placement.close(name)
            await self._close_actor(name)
            await self._apply(update)

    async def _close_actor(self, name: str) -> None:
        handle = self.handles.pop(name, None)
        if name in self.history:
            self.history[name]["closed"] = True
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
        if self.placement is None or name not in self.placement.buckets:
            return
        members, update = self.placement.close(name)
        self.handles.pop(name, None)
        if name in self.history:
            self.history[name].update(closed=True, died=died, lost=members)
        await self._apply(update)

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
    async def bucket_of(self, trial_id: str):
        """``(bucket name, handle)`` of the trial's bucket, or ``None``."""
        name = None if self.placement is None else self.placement.bucket_of(trial_id)
        return None if name is None else (name, self.handles.get(name))

    async def free_slots(self, structural_key: Hashable) -> int:
        """Free slots in open buckets whose structural key is ``structural_key``."""
        if self.placement is None:
            return 0
        return sum(r.free for r in self.placement.buckets.values() if r.key[2] == structural_key)

    async def stats(self) -> dict[str, dict]:
        """Every bucket this pool opened: model, bucket_size, capacity (less after
        compaction), the trials it fused (``trials``), its current members, and
        whether it closed, died or reaped members."""
        out = {}
        for name, info in self.history.items():
            record = self.placement.buckets.get(name) if self.placement else None
            out[name] = {**info, "trials": list(info["trials"]), "reaped": list(info.get("reaped", [])),
                         "members": list(record.members) if record else []}
        return out

    async def shutdown(self) -> None:
        for name in list(self.handles):
            await self._close_actor(name)


PoolActor = ray.remote(ChorusPool)


# ----- driver-side helpers -------------------------------------------------------------------------
def get_pool(create: bool = False, job_id: str | None = None):
    """The pool of this job (creating it when ``create``), or ``None``."""
    name = pool_name(job_id)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    return PoolActor.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, scheduling_strategy="DEFAULT", max_restarts=0,
    ).remote(job_id or ray.get_runtime_context().get_job_id())


def retire_trial(trial_id: str, timeout_s: float = 60.0) -> None:
    """Retire ``trial_id``'s member in its bucket now (e.g. from a scheduler's
    ``on_trial_result`` when it decides STOP): its slot is freed and the other
    members go on without it. Idempotent; a no-op for a trial that never joined
    or when no pool runs. Its last state stays available to a checkpoint at end."""
    if not ray.is_initialized():
        return
    pool = get_pool(create=False)
    if pool is not None:
        ray.get(pool.leave.remote(trial_id), timeout=timeout_s)


def set_waiting(counts: dict) -> None:
    """Tell this run's pool how many trials of each structural key are held back
    by a searcher (a bucket they would refill is not compacted)."""
    if not ray.is_initialized():
        return
    pool = get_pool(create=False)
    if pool is not None:
        pool.set_waiting.remote(dict(counts))


def free_slots(structural_key: Hashable) -> int:
    """Free slots in this run's open buckets of ``structural_key`` (0 when no pool runs)."""
    if not ray.is_initialized():
        return 0
    pool = get_pool(create=False)
    return 0 if pool is None else ray.get(pool.free_slots.remote(structural_key))


def bucket_stats() -> dict[str, dict]:
    """Per bucket of this run's pool: model, capacity, and the trials it fused."""
    if not ray.is_initialized():
        return {}
    pool = get_pool(create=False)
    return {} if pool is None else ray.get(pool.stats.remote())
