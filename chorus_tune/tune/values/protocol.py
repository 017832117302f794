"""What the pool and its callers share: the pool's name and namespace, its
answers' markers, bucket names, a task's id, a trial's :class:`Reservation`,
and :class:`PoolLost` (docs/design.md D2, "Faults"). Values only: the pool
actor (``actors/pool.py``) and its one client (``client.py``) both import it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import ray

from chorus_tune.tune.values.plan import Plan

NAMESPACE = "chorus_tune"
NEED_TASK = "chorus/need-task"
QUEUED = "chorus/queued"
# In place of a bucket's handle: the member trains in its trial's own process
# (chorus_tune.tune.rules.solo), where no bucket actor holds it.
SOLO = "chorus/solo"


def pool_name(job_id: str | None = None) -> str:
    """The pool's actor name for ``job_id`` (default: the calling process's job)."""
    return f"chorus-pool-{job_id or ray.get_runtime_context().get_job_id()}"


def bucket_prefix(job_id: str, generation: int = 0) -> str:
    """Names of a pool's buckets: ``chorus-bucket-<job>-<n>``, with ``-p<generation>``
    before ``<n>`` for a pool that replaced a lost one."""
    return f"chorus-bucket-{job_id}" + (f"-p{generation}" if generation else "")


class PoolLost(RuntimeError):
    """The pool actor of this run died (docs/design.md "Faults"): what it knew
    (who reads which member, where) is gone. Its buckets close themselves; a
    trial that hits this restarts from its checkpoint with a new pool."""


def pool_lost(exc: BaseException, waiting_for: str) -> PoolLost:
    """The error a trial (or the driver) raises when the pool died while it ``waiting_for``."""
    return PoolLost(
        f"the chorus pool actor {pool_name()} died ({type(exc).__name__}) while {waiting_for}; its buckets "
        "close themselves. With FailureConfig(max_failures>=1) Tune restarts the trial from its last "
        "checkpoint, and a new pool places it in a new bucket.")


def task_id(task_blob: bytes) -> str:
    return hashlib.sha256(task_blob).hexdigest()[:16]


@dataclass(frozen=True)
class Reservation:
    """Where a trial reads its results: its member, that member's seed and plan,
    and the bucket that holds it (``bucket``/``handle`` are ``None`` while the
    member waits for a slot: then :meth:`ChorusPool.await_placement`).
    ``seated``: ChorusSearch seated (and built) the member before the trial
    existed; otherwise the trial's first request builds it. ``solo``: the
    trial trains the member itself (``bucket`` names its place in the pool's
    budget; ``handle`` is ``None``)."""

    member: str
    seed: int
    plan: Plan
    bucket: str | None
    handle: Any
    seated: bool
    token: int = 0  # names this reservation when the trial leaves (see ChorusPool.trial_left)
    solo: bool = False
