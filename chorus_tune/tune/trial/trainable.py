"""ChorusTrainable: a Tune trial that reads one member of a fused bucket (docs/design.md D1, D3).

The trainable is a thin client. It holds no model, data or tensors: the task
travels as bytes it never unpickles, member states as bytes it only passes on.
The first ``step`` finds its member through the pool (seated already by
ChorusSearch, or one of its own, built then — fresh, or from the state a
``load_checkpoint`` handed over); an actor Tune stops before it steps holds
nothing. The bucket trains members ahead of their
trials. A ``step`` with no result in hand fetches every result of the member
the bucket has queued, in one call (waiting only if the bucket has not
computed the next one yet), and the steps after it return them one at a time
(:class:`~chorus_tune.tune.trial.read_ahead.ReadAhead`).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.tune import Trainable
from ray.tune.execution.placement_groups import PlacementGroupFactory

from chorus_tune.config_keys import users_config
from chorus_tune.tune import client
from chorus_tune.tune.actors.liveness import current_actor_id
from chorus_tune.tune.client import get_pool
from chorus_tune.tune.observe.actor_log import log_to_actor_stdout
from chorus_tune.tune.rules.regrouping import Moved
from chorus_tune.tune.rules.resources import FALLBACK_TOKEN_CPU, bucket_resources, trial_token_cpu
from chorus_tune.tune.rules.waits import Evicted, Stall, StalledWait
from chorus_tune.tune.trial.checkpoint import write_weights
from chorus_tune.tune.trial.read_ahead import ReadAhead
from chorus_tune.tune.trial.solo_run import SoloRun
from chorus_tune.tune.values import run_plan
from chorus_tune.tune.values.options import BucketOptions, Join, member_seed
from chorus_tune.tune.values.protocol import SOLO, Reservation, pool_lost, task_id

logger = logging.getLogger(__name__)

# 2: the member's bytes hold its weights apart (state_io), and the directory a weights file.
CHECKPOINT_FORMAT = 2
_LEAVE_TIMEOUT_S = 30.0
_PLACEMENT_POLL_S = 10.0  # how often a trial waiting for its bucket asks the pool what it waits for
# Every ChorusTrainable class with a task made in this process: a ChorusSearch
# without task= sends a scout only if the run's trainable can be one of these.
_TASK_CLASSES: "weakref.WeakSet[type]" = weakref.WeakSet()
# The jobs whose pool this process has started early, by Ray instance (a new
# local Ray numbers its jobs from 1 again).
_POOL_STARTED: set[tuple[str, str]] = set()


def task_classes_exist() -> bool:
    return len(_TASK_CLASSES) > 0


def _start_pool_early() -> None:
    """Start this job's pool now, in the driver, as Tune creates its trials
    (``default_resource_request``), rather than in the first trial's ``setup``:
    the pool's start (a Ray worker, torch's import) then overlaps the trial
    actors' own, instead of coming after one. Measured side by side on this
    2-core machine (``benchmarks/first_result.py``: a fresh Ray, 4 trials
    under Tune's default search): the first result came 8.3-8.9 s after
    ``fit()``, against 10.4-11.5 s without (medians 8.6 and 11.1 s).
    Once per job in this process; best effort: the trial's ``setup`` still
    creates the pool if it is not there, and reports what goes wrong then."""
    context = ray.get_runtime_context()
    job = context.get_job_id()
    started = (context.gcs_address, job)
    if started in _POOL_STARTED:
        return
    _POOL_STARTED.add(started)
    try:
        get_pool(create=True)
    except Exception:  # noqa: BLE001 - best effort; setup creates it and raises for itself
        logger.debug("could not start the pool of job %s early", job, exc_info=True)


class BucketLost(RuntimeError):
    """The bucket holding this trial's member died; the member's progress since
    its last checkpoint is lost."""


class ChorusTrainable(Trainable):
    """A Tune trainable whose trials train fused, K to a bucket, ahead of Tune.

    Make one with :meth:`for_task` (preferred: the task then travels to the
    buckets as bytes that trial actors never unpickle), or subclass with a
    ``task`` class attribute. Class attributes (and ``for_task`` keywords) are
    the fields of :class:`BucketOptions`: ``bucket_size``,
    ``resources_per_bucket``, ``route``, ``run_ahead``, ``speculate``, ``max_iterations``,
    ``ahead_memory_mb``, ``gather_s``, ``result_timeout_s``,
    ``reap_interval_s``, ``idle_close_s``, ``max_buckets``, ``compact``,
    ``compact_after_s``, ``regroup``, ``max_bucket_size``, ``memory_fraction``, ``solo``,
    ``solo_below``, ``memory_meter`` (``bucket_size="auto"``: see :class:`BucketOptions`).

    Every result carries the member's metrics (``train_loss``, ``val_loss``,
    ``val_accuracy``, ``iteration``) and the ``chorus/*`` fields of
    :mod:`chorus_tune.tune.values.result_keys`.

    In Ray's dashboard a trial actor shows as ``ChorusTrainable(started for
    trial <trial id>)``: Tune names no actor, and Ray captures a repr once,
    after ``setup``. With ``reuse_actors`` the actor then serves later trials
    too; its log says which, with their member and bucket, as each starts.
    """

    task: Any = None
    # Defaults come from BucketOptions, the one place that defines them.
    bucket_size: int | str = BucketOptions.bucket_size
    resources_per_bucket: dict | None = None
    route: str = BucketOptions.route
    run_ahead: int = BucketOptions.run_ahead
    speculate: bool = BucketOptions.speculate
    max_iterations: int | None = BucketOptions.max_iterations
    ahead_memory_mb: float = BucketOptions.ahead_memory_mb
    gather_s: float = BucketOptions.gather_s
    result_timeout_s: float = BucketOptions.result_timeout_s
    reap_interval_s: float = BucketOptions.reap_interval_s
    idle_close_s: float = BucketOptions.idle_close_s
    max_buckets: int | None = BucketOptions.max_buckets
    compact: bool = BucketOptions.compact
    compact_after_s: float = BucketOptions.compact_after_s
    regroup: bool = BucketOptions.regroup
    max_bucket_size: int | None = BucketOptions.max_bucket_size
    memory_fraction: float = BucketOptions.memory_fraction
    solo: bool = BucketOptions.solo
    solo_below: float | None = BucketOptions.solo_below
    memory_meter: Any = None

    # False: one call to the bucket per result, as before results were fetched
    # ahead (kept to measure one against the other in one run; docs/design.md D3).
    _read_ahead: bool = True
    _task_blob: bytes | None = None
    _factory_blob: bytes | None = None
    _task_id: str | None = None

    # ----- making the class -----------------------------------------------------------------------
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        task = cls.__dict__.get("task")
        if task is not None:
            cls._task_blob = cloudpickle.dumps(task)
            cls._factory_blob = cloudpickle.dumps(task.model)
            cls._task_id = task_id(cls._task_blob)
        if cls.__dict__.get("_task_blob") is not None:
            _TASK_CLASSES.add(cls)

    @classmethod
    def for_task(cls, task: Any, bucket_size: int | str = 16, name: str = "ChorusTrainable",
                 **options: Any) -> type["ChorusTrainable"]:
        """A ChorusTrainable class for ``task`` (a :class:`chorus_tune.Task`)."""
        unknown = set(options) - set(BucketOptions.__dataclass_fields__) - {"resources_per_bucket"}
        if unknown:
            raise TypeError(f"unknown ChorusTrainable option(s): {sorted(unknown)}")
        blob = cloudpickle.dumps(task)
        attrs = {"bucket_size": bucket_size, "_task_blob": blob, "_factory_blob": cloudpickle.dumps(task.model),
                 "_task_id": task_id(blob), "__module__": __name__, **options}
        trainable = type(name, (cls,), attrs)
        trainable.bucket_options()  # validate now, not in the first trial
        return trainable

    @classmethod
    def bucket_options(cls) -> BucketOptions:
        values = {f.name: getattr(cls, f.name) for f in dataclasses.fields(BucketOptions)}
        values["resources_per_bucket"] = BucketOptions.resources(cls.resources_per_bucket)
        return BucketOptions(**values)

    @classmethod
    def default_resource_request(cls, config: dict) -> PlacementGroupFactory:
        # Tune rejects an all-zero request, and the work is done by the
        # buckets: the tokens hold the buckets' cores between them under
        # ChorusSearch, and under Tune's default search are sized so Tune runs
        # about as many trials as there are slots (chorus_tune.tune.rules.resources).
        token = FALLBACK_TOKEN_CPU
        concurrency = run_plan.take_trial_concurrency()  # a trial ChorusSearch suggested
        solo = run_plan.take_trial_solo()
        if ray.is_initialized():
            _start_pool_early()
            cluster = ray.cluster_resources()
            per_bucket = bucket_resources(cls.resources_per_bucket, cluster)
            size = cls.bucket_options().expected_size
            if solo:
                # It trains its member itself (rules/solo.py): one bucket's cores, as
                # plain Tune's trial holds its CPU, so Tune runs no more of them at
                # once than the cores train (and no more processes load torch).
                token = float(per_bucket.get("CPU", 1.0))
            elif concurrency is not None:
                # The trials ChorusSearch runs at once hold the buckets' cores
                # (the open buckets share every core where there is no GPU
                # and the resources are the default: the pool's _share_cores).
                shares = cluster.get("GPU", 0) <= 0 and cls.resources_per_bucket is None
                token = trial_token_cpu(cluster, per_bucket, size, concurrency=concurrency, shares_cores=shares)
            elif cls.max_buckets is not None:
                slots = size * cls.max_buckets
                token = max(1e-4, round(cluster.get("CPU", 1) / slots - 5e-5, 4))
            else:
                token = trial_token_cpu(cluster, per_bucket, size)
        return PlacementGroupFactory([{"CPU": token}])

    # ----- Trainable API --------------------------------------------------------------------------
    def __repr__(self) -> str:
        # Ray shows this in the dashboard's Actors page, captured once after
        # __init__: the trial the actor started for is the one thing that
        # stays true when reuse_actors hands it later trials.
        return f"{type(self).__name__}(started for trial {getattr(self, '_started_for', None)})"

    def setup(self, config: dict) -> None:
        log_to_actor_stdout(logger)
        if not hasattr(self, "_started_for"):
            self._started_for = self.trial_id
        if self._task_blob is None:
            raise TypeError(f"{type(self).__name__} has no task: use ChorusTrainable.for_task(task) "
                            "or set a `task` class attribute")
        self._member: str | None = None
        self._bucket = None
        self._bucket_name: str | None = None
        self._joined = False
        self._seated = False
        self._plan = None
        self._pending_state: bytes | None = None
        self._seed: int | None = None
        self._setup_error: BaseException | None = None
        self._reads = ReadAhead()  # results fetched from the bucket that Tune has yet to get
        self._solo_run: SoloRun | None = None  # the member this trial trains itself (rules/solo.py)
        # The member is reserved at the first step, not here: Tune may create
        # an actor for a trial, then hand the trial to a cached actor and stop
        # this one unused (TuneController._maybe_reuse_cached_actor). Reserving
        # here, the unused actor took the trial's member from the actor Tune
        # kept, and its stop made that member leave (seen as trials restarted
        # after a node was lost: "member ... is not in bucket", and a checkpoint
        # holding the state of an iteration before its own).
        self._unreserved = True

    def step(self) -> dict:
        fetched = self._reads.take()
        if fetched is not None:
            return fetched
        if self._unreserved:
            self._reserve(self.config)
            if self._seated and self._pending_state is not None:
                # Restoring (load_checkpoint came first): a seated member trains
                # from scratch, so the trial takes a member of its own.
                self._leave()
                self._reserve(self.config)
        if self._setup_error is not None:
            raise self._setup_error
        if self._bucket is None:
            # Waiting for a slot: wait here, where Tune expects a trial to take its time.
            self._bucket_name, self._bucket = self._await_placement()
            self._announce()
        if self._trains_solo:
            return self._solo_step()
        join = None
        if not self._joined and not self._seated:
            join = Join(config=self._clean(self.config), seed=self._seed, state=self._pending_state,
                        plan=self._plan)
        try:
            # Every result queued for the member, in one call: the call costs
            # more than Tune's own work per result. The bucket learns here how
            # far Tune read the last ones.
            if self._read_ahead:
                results = ray.get(self._bucket.next_results.remote(self._member, join, current_actor_id(),
                                                                   self._reads.read),
                                  timeout=self.result_timeout_s)
            else:
                results = [ray.get(self._bucket.next_result.remote(self._member, join, current_actor_id()),
                                   timeout=self.result_timeout_s)]
        except RayActorError as exc:
            self._lost_bucket(exc)
        except Evicted:
            return self._rejoin()
        except Moved:
            self._follow_move()
            return self.step()
        except GetTimeoutError as exc:
            raise TimeoutError(
                f"trial {self.trial_id} waited {self.result_timeout_s}s (result_timeout_s) for member "
                f"{self._member}'s next result from bucket {self._bucket_name}") from exc
        self._joined, self._pending_state = True, None
        self._reads.fill(results)
        return self._reads.take()

    def save_checkpoint(self, checkpoint_dir: str) -> dict:
        state = self._pending_state
        if self._joined and self._trains_solo:
            state = self._solo_run.state()
        elif self._joined:
            try:
                # The state of the iteration Tune read last, not of the last one fetched.
                try:
                    state = ray.get(self._bucket.save.remote(self._member, self._reads.read),
                                    timeout=self.result_timeout_s)
                except Moved:
                    self._follow_move()
                    state = ray.get(self._bucket.save.remote(self._member, self._reads.read),
                                    timeout=self.result_timeout_s)
            except RayActorError as exc:
                self._lost_bucket(exc)
            except GetTimeoutError as exc:
                raise TimeoutError(f"trial {self.trial_id} waited {self.result_timeout_s}s (result_timeout_s) "
                                   f"for member {self._member}'s state from bucket {self._bucket_name}") from exc
        # The weights alone, as a file that loads without running code
        # (torch.load(weights_only=True)): taken out of the bytes without torch.
        write_weights(checkpoint_dir, state)
        return {
            "chorus_format": CHECKPOINT_FORMAT,
            "member": state,  # bytes (chorus_tune.tune.values.state_io), or None before the first result
            "factory": self._factory_blob,  # what load_model needs to rebuild the user's module
            "config": self._clean(self.config),
            "seed": self._seed,
            "bucket": self._bucket_name,
        }

    def load_checkpoint(self, checkpoint: dict) -> None:
        if self._joined or self._seated:
            # Restoring a member that trains (PBT exploit, a seated member):
            # leave it, dropping its queued results, and come back with the state.
            self._leave()  # its next reservation (at the next step) gets a member of its own
            self._unreserved = True
        self._pending_state = checkpoint.get("member")
        if checkpoint.get("seed") is not None:
            self._seed = int(checkpoint["seed"])

    def reset_config(self, new_config: dict) -> bool:
        # Actor reuse: this actor now serves another trial (Tune already switched trial_id).
        self._leave()
        self._pending_state, self._setup_error = None, None
        self._unreserved = True  # reserved at its first step (see setup)
        return True

    def cleanup(self) -> None:
        self._leave()

    # ----- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _clean(config: dict) -> dict:
        return users_config(config)

    def _reserve(self, config: dict) -> None:
        config = self._clean(config)
        self._unreserved = False
        self._joined = False
        self._bucket, self._bucket_name = None, None
        options = self.bucket_options()
        trial = self.trial_id
        try:
            seed = member_seed(config, trial)
            # A pool that died is made anew: this is a fresh reservation anyway.
            reply = client.reserve(trial, self._task_id, self._task_blob, config, options, current_actor_id(), seed)
        except Exception as exc:  # noqa: BLE001 - e.g. the model factory raised for this config
            # Raised from step(), so that Tune reports it as this trial's error.
            self._setup_error = exc
            return
        assert isinstance(reply, Reservation)
        self._member, self._seed, self._plan, self._seated = reply.member, reply.seed, reply.plan, reply.seated
        self._reserved_for = (trial, reply.token)  # reset_config switches trial_id before this trial leaves
        self._bucket_name, self._bucket = reply.bucket, SOLO if reply.solo else reply.handle
        if self._bucket is not None:
            self._announce()

    @property
    def _trains_solo(self) -> bool:
        # The pool's marker in place of a bucket's handle (a handle is never a str).
        return isinstance(self._bucket, str) and self._bucket == SOLO

    def _solo_step(self) -> dict:
        """Train this trial's member here, one iteration (rules/solo.py says when)."""
        if self._solo_run is None:
            self._solo_run = SoloRun(self._task_blob, self._task_id, self._member, self._bucket_name,
                                     self._clean(self.config), self._seed, self._pending_state, self._plan)
            self._joined, self._pending_state = True, None
        result = self._solo_run.step()
        self._reads.fill([result])
        return self._reads.take()

    def _await_placement(self) -> tuple[str, Any]:
        """Wait for this trial's member to get a bucket: as long as the sweep
        moves, since a slot frees when other members finish; an error naming
        what it waited for once nothing moves for ``result_timeout_s``, at once
        when the bucket can never start, and when the pool dies."""
        what = f"trial {self.trial_id} waited for a bucket for member {self._member}"
        stall = Stall(self.result_timeout_s, what)
        ref = client.placement(self._member)
        while True:
            try:
                return ray.get(ref, timeout=_PLACEMENT_POLL_S)
            except GetTimeoutError:
                pass
            except RayActorError as exc:
                raise pool_lost(exc, what) from exc
            try:
                status = ray.get(client.wait_status(self._member), timeout=_PLACEMENT_POLL_S)
            except GetTimeoutError:
                status = {"progress": None, "waits_for": None, "hopeless": False}  # busy: not progress
            except RayActorError as exc:
                raise pool_lost(exc, what) from exc
            if status["hopeless"]:
                raise StalledWait(f"{what}: it waits for {status['waits_for']}, so it can never start")
            stall.seen(status["progress"], status["waits_for"])

    def _rejoin(self) -> dict:
        """Our member gave its slot to a waiting one (we had not asked for a
        while): take its state at the last result we read and join again, in
        the queue like any member, so the next result is the one it owed."""
        try:
            state = ray.get(self._bucket.save.remote(self._member, self._reads.read), timeout=self.result_timeout_s)
        except RayActorError as exc:
            self._lost_bucket(exc)
        logger.info("trial %s: member %s gave its slot up while idle; it rejoins", self.trial_id, self._member)
        self._leave()
        self._pending_state = state
        self._reserve(self.config)
        return self.step()

    def _follow_move(self) -> None:
        """Our member moved to another bucket of its structure (regrouping)
        and we read every result the old one held: read on in the new one."""
        try:
            self._bucket_name, self._bucket = ray.get(client.moved_to(self._member, self._bucket_name),
                                                      timeout=self.result_timeout_s)
        except RayActorError as exc:
            raise pool_lost(exc, f"trial {self.trial_id} asked where member {self._member} moved") from exc
        self._joined = True  # built there from its state: nothing to join with
        self._announce()

    def _announce(self) -> None:
        # The actor's log is where the dashboard tells which trial it serves
        # now (its repr names only the first, see __repr__).
        logger.info("trial %s reads member %s in bucket %s", self.trial_id, self._member, self._bucket_name)

    def _leave(self) -> None:
        # Results fetched and not yet returned are dropped: Tune stopped the
        # trial, or it takes another member (reset_config, load_checkpoint).
        read = self._reads.drop()
        finished = self._solo_run.finished if self._solo_run is not None else None
        self._solo_run = None
        member, self._member = self._member, None
        self._joined, self._seated = False, False
        if member is None:
            return
        try:
            # reset_config switches trial_id before this trial leaves. Not waited
            # for: leaving may wait for the bucket's running iteration, and Tune
            # would hold this actor's next trial for it.
            trial, token = getattr(self, "_reserved_for", (member, None))
            client.trial_left(trial, token, read, finished)
        except Exception as exc:  # noqa: BLE001 - leaving must never fail a trial
            logger.warning("trial %s: leaving its bucket failed: %s", member, exc)

    def _lost_bucket(self, exc: BaseException) -> None:
        name = self._bucket_name
        try:
            client.bucket_failed(name, _LEAVE_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            pass
        self._member, self._joined, self._seated = None, False, False
        self._reads.drop()
        raise BucketLost(
            f"bucket {name} holding trial {self.trial_id}'s member died ({type(exc).__name__}); the member's "
            "progress since its last checkpoint is lost. With FailureConfig(max_failures>=1) Tune restarts "
            "the trial from its last checkpoint in a new bucket.") from exc
