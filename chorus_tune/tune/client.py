"""The one way the Tune adapters (trial, search, schedulers) and the driver reach
the pool actor: find or make it, call it with one retry on a new pool, and the
public helpers (``retire_trial``, ``close_idle_buckets``, ``free_slots``,
``bucket_stats``). docs/design.md D2."""
from __future__ import annotations

import logging
from typing import Any, Hashable

import ray
from ray.exceptions import RayActorError

from chorus_tune.tune.actors.cluster import pool_scheduling_strategy
from chorus_tune.tune.actors.pool import PoolActor
from chorus_tune.tune.values.protocol import NAMESPACE, pool_lost, pool_name

logger = logging.getLogger(__name__)


def call_pool(method: str, *args: Any, timeout_s: float | None = None) -> Any:
    """``ray.get(pool.<method>.remote(*args))`` from the driver (ChorusSearch):
    if the pool died, once more on a new pool (made now). Raises
    :class:`PoolLost` when that fails too."""
    for attempt in range(2):
        try:
            return ray.get(getattr(get_pool(create=True), method).remote(*args), timeout=timeout_s)
        except RayActorError as exc:
            if attempt:
                raise pool_lost(exc, f"the driver called {method}") from exc
            logger.warning("chorus pool %s died: making a new one", pool_name())
            _forget_dead_pool()


def _forget_dead_pool(wait_s: float = 10.0) -> None:
    """Wait (at most ``wait_s``) until the dead pool's name is free: Ray
    releases a dead actor's name soon after it dies, and a new pool needs it."""
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pool = get_pool(create=False)
        if pool is None:
            return
        try:
            ray.get(pool.__ray_ready__.remote(), timeout=1.0)
            return  # a live pool holds the name (another caller made it first)
        except RayActorError:
            time.sleep(0.2)
        except Exception:  # noqa: BLE001 - busy: alive
            return


def get_pool(create: bool = False, job_id: str | None = None):
    """The pool of this job (creating it when ``create``), or ``None``."""
    if not create and not ray.is_initialized():
        # Looking one up must not start a Ray node (``ray.get_runtime_context`` would): a solo
        # member run outside Ray (a test, a script) has no pool to find.
        return None
    name = pool_name(job_id)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    return PoolActor.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, scheduling_strategy=pool_scheduling_strategy(), max_restarts=0,
    ).remote(job_id or ray.get_runtime_context().get_job_id())


def retire_trial(trial_id: str, timeout_s: float = 60.0) -> None:
    """Retire ``trial_id``'s member in its bucket now (e.g. from a scheduler's
    ``on_trial_result`` when it decides STOP): its slot is freed and the other
    members go on without it. Idempotent; a no-op for a trial that never joined
    or when no pool runs. Its last state stays available to a checkpoint at end."""
    pool = get_pool(create=False)
    if pool is not None:
        ray.get(pool.trial_left.remote(trial_id), timeout=timeout_s)


def close_idle_buckets(timeout_s: float = 60.0) -> list[str]:
    """Close this job's idle buckets (no member in their slots) now, instead of
    their ``idle_close_s`` later, and free what they hold (a GPU): for a script
    that needs the device right after a sweep. A bucket still closes only once
    its trials have read every result. Returns their names; ``[]`` when no pool runs."""
    pool = get_pool(create=False)
    return [] if pool is None else ray.get(pool.close_idle.remote(), timeout=timeout_s)


def free_slots(structural_key: Hashable) -> int:
    """Free slots in this run's open buckets of ``structural_key``, a sharing key
    (``chorus_tune.stack.sharing_key``; 0 when no pool runs)."""
    pool = get_pool(create=False)
    return 0 if pool is None else ray.get(pool.free_slots.remote(structural_key))


def bucket_stats() -> dict[str, dict]:
    """Per bucket of this run's pool: model, capacity, and the trials it fused."""
    pool = get_pool(create=False)
    return {} if pool is None else ray.get(pool.stats.remote())


# ----- what ChorusSearch asks of the pool (docs/design.md D10) ------------------------------------
def seat(seats: list[tuple[str, dict, int]], task_id: str, task_blob: bytes | None, options: Any,
         plan: Any) -> dict[str, str]:
    """Seat members ``(member, config, seed)`` in buckets of their structure now:
    per member, ``"seated"``, ``"queued"``, ``"solo"`` (its trial trains it,
    rules/solo.py) or ``"failed"``. The task's bytes go only when the pool asks
    for them (a new pool has never seen the task): ``task_blob`` ``None`` then
    fails, naming the task."""
    from chorus_tune.tune.values.protocol import NEED_TASK

    out = call_pool("seat", seats, task_id, None, options, plan)
    if out == NEED_TASK:
        if task_blob is None:
            raise RuntimeError(f"the pool lost task {task_id}, whose bytes this driver never had "
                               "(ChorusSearch learnt it from a scout trial)")
        out = call_pool("seat", seats, task_id, task_blob, options, plan)
    return out


def bind(trial_id: str, candidates: list[str]) -> str | None:
    """The seated member (of ``candidates``) the pool binds trial ``trial_id`` to, or ``None``."""
    return call_pool("bind", trial_id, candidates)


def trains_solo(member: str) -> bool:
    """Whether seated ``member`` trains solo (in its trial's process) now."""
    return bool(call_pool("trains_solo", member))


def bind_again(bindings: dict[str, str]) -> None:
    """After a restore: bind each trial to its member again; a member whose
    trial restarted meanwhile and reads a member of its own leaves."""
    for trial_id, member in bindings.items():
        if bind(trial_id, [member]) is None:
            call_pool("leave", member)


def bucket_size_for(task_id: str, options: Any, config: dict) -> int:
    """Slots of a new bucket for members like ``config`` (measured, for ``bucket_size="auto"``)."""
    return call_pool("bucket_size_for", task_id, options, config)


def expect_scout(trial_id: str, seat_: tuple[str, dict, int]) -> None:
    """Trial ``trial_id`` is a scout: its first step teaches the pool the task; its member is ``seat_``."""
    call_pool("expect_scout", trial_id, seat_)


def scout_task(trial_id: str) -> Any:
    """``(task id, bucket options)`` the scout taught the pool, or ``None`` while it has not."""
    return call_pool("scout_task", trial_id)


def new_run(seated_by: str) -> None:
    """A new run starts (not waited for): the pool lets go of what an earlier run seated and no trial read."""
    get_pool(create=True).new_run.remote(seated_by)


def learn_task(task_id: str, task_blob: bytes) -> None:
    """Teach the pool the run's task before its first seat (not waited for): it starts loading the data."""
    get_pool(create=True).learn_task.remote(task_id, task_blob)


def input_row(task_id: str, task_blob: bytes, timeout_s: float = 60.0) -> Any:
    """The first input row of the task's data, from the pool's load of it, or
    ``None`` where the pool loads none (a machine with GPUs) or cannot answer."""
    pool = get_pool(create=False)
    if pool is None:
        return None
    try:
        return ray.get(pool.input_row.remote(task_id, task_blob), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - the caller loads the data itself, as before
        return None


def announce_rungs(trial_id: str, schedule: Any) -> None:
    """ChorusASHA's rungs for trial ``trial_id`` (not waited for)."""
    get_pool(create=True).set_plan.remote(trial_id, schedule)


# ----- what a ChorusTrainable asks of the pool (docs/design.md D2, D3) -----------------------------
def reserve(trial_id: str, task_id: str, task_blob: bytes, config: dict, options: Any, actor_id: Any,
            seed: int) -> Any:
    """Trial ``trial_id``'s :class:`~chorus_tune.tune.values.protocol.Reservation`: the
    member it reads and where. The task's bytes go only when the pool asks for them."""
    from chorus_tune.tune.values.protocol import NEED_TASK

    reply = call_pool("reserve", trial_id, task_id, None, config, options, actor_id, seed)
    if reply == NEED_TASK:
        reply = call_pool("reserve", trial_id, task_id, task_blob, config, options, actor_id, seed)
    return reply


def placement(member: str) -> Any:
    """A Ray reference to ``(bucket name, handle)`` of ``member`` once it has a bucket (not waited for here)."""
    return get_pool(create=True).await_placement.remote(member)


def wait_status(member: str) -> Any:
    """A Ray reference to what ``member``'s wait for a bucket waits for (``ChorusPool.wait_status``)."""
    return get_pool(create=True).wait_status.remote(member)


def moved_to(member: str, source: str) -> Any:
    """A Ray reference to ``(bucket name, handle)`` where ``member``, moved out of ``source``, trains now."""
    return get_pool(create=True).moved_to.remote(member, source)


def trial_left(trial_id: str, token: int | None, read: int | None, finished: bool | None = None) -> None:
    """Trial ``trial_id`` leaves its member (not waited for: leaving may wait for
    the bucket's running iteration). ``finished``: a solo trial's, whether its
    last result ended its member. A no-op when no pool runs."""
    pool = get_pool(create=False)
    if pool is not None:
        pool.trial_left.remote(trial_id, token, read, finished)


def bucket_failed(name: str, timeout_s: float) -> None:
    """Tell the pool bucket ``name`` died (waited for at most ``timeout_s``). A no-op when no pool runs."""
    pool = get_pool(create=False)
    if pool is not None:
        ray.get(pool.bucket_failed.remote(name), timeout=timeout_s)
