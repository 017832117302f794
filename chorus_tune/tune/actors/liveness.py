"""Whether the trial actor reading a member is gone, known by the actor's id.

A trial gives the pool and its bucket its actor's *id*, never its handle.
Receiving a handle makes Ray load the actor's class into the receiving
process, and a ChorusTrainable's class imports all of ``ray.tune``: 1.9 s of
a bucket process's start on an idle 2-core machine (measured; a fifth of a
small sweep's time in a fresh bucket), spent only so that the reaper can ask
whether the trial is still there. The id is asked of Ray's control store (the
GCS actor table) instead, which needs no dashboard.
"""
from __future__ import annotations

import logging

import ray

from chorus_tune.tune.rules.waits import EVICT_IDLE_S

logger = logging.getLogger(__name__)

ActorId = str  # the hex id, as ``ray.get_runtime_context().get_actor_id()`` gives it


def current_actor_id() -> ActorId | None:
    """This process's actor id, or None outside an actor (a local test): no liveness checks then."""
    try:
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - not connected, or not an actor
        return None


def actor_state(actor_id: ActorId) -> str | None:
    """The actor's state in the GCS (``"ALIVE"``, ``"DEAD"``, ...), None if it is not known there."""
    # ray._private.state.actors is Ray's own GCS reader (ray.util.state needs the
    # dashboard's API server, which a user may not run). Private, so if a Ray
    # upgrade moves it, no trial is ever taken for dead: liveness is lost, with a warning.
    try:
        from ray._private import state
    except ImportError:  # pragma: no cover - depends on the Ray version
        _warn_once()
        return None
    try:
        info = state.actors(actor_id=actor_id)
    except AttributeError:  # pragma: no cover - depends on the Ray version
        _warn_once()
        return None
    return info.get("State") if info else None


def is_dead(actor_id: ActorId) -> bool:
    """Whether the GCS knows the actor is dead. Unknown or unreachable is not dead:
    the reaper then looks again at its next round. An actor the GCS no longer
    lists (it keeps the last 100,000 dead ones by default) is not taken for dead
    either: reaping a live member would lose its state, while a dead trial's
    member that is never reaped gives its slot up once a member waits for one
    (``waits.EVICT_IDLE_S``)."""
    try:
        return actor_state(actor_id) == "DEAD"
    except Exception:  # noqa: BLE001 - the GCS busy or unreachable for now: not known dead
        return False


def dead_among(actor_ids: set[ActorId]) -> set[ActorId]:
    """The ids in ``actor_ids`` the GCS knows are dead (one lookup each: a bucket watches at most its slots)."""
    return {actor_id for actor_id in actor_ids if is_dead(actor_id)}


_WARNED: list[bool] = []


def _warn_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        logger.warning("this Ray has no ray._private.state.actors: members of dead trial actors are "
                       "not reaped (a slot of one frees once a member waits for it, after %.0f s idle)",
                       EVICT_IDLE_S)
