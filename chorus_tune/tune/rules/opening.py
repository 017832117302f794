"""What the pool opens a new bucket with (Ray-free; the pool creates the actor).

A bucket is given its size as a number (an ``"auto"`` size was measured for
its key, :mod:`~.sizing`) and the resources it claims, resolved against the
cluster (:mod:`~.resources`). Its actor is created **outside every trial's
placement group** (``scheduling_strategy="DEFAULT"``, docs/design.md D2): Tune
captures child actors into the trial's group, and a bucket created there would
die with that trial. It is never restarted: a bucket that dies loses its
members' state, and their trials restart from their checkpoints.
"""
from __future__ import annotations

from typing import Mapping

from chorus_tune.tune.rules.resources import bucket_actor_options
from chorus_tune.tune.values.options import BucketOptions


def new_bucket_options(options: BucketOptions, capacity: int, resources: Mapping[str, float]) -> BucketOptions:
    """The options a bucket of ``capacity`` slots claiming ``resources`` is
    made with: the run's ``options``, with the size and resources fixed."""
    return BucketOptions(**{**options.__dict__, "bucket_size": capacity,
                            "resources_per_bucket": BucketOptions.resources(resources)})


def actor_options(name: str, namespace: str, resources: Mapping[str, float]) -> dict:
    """``BucketActor.options(...)`` for bucket ``name``: named in ``namespace``,
    outside every placement group, never restarted, claiming ``resources``."""
    return {"name": name, "namespace": namespace, "scheduling_strategy": "DEFAULT", "max_restarts": 0,
            **bucket_actor_options(resources)}
