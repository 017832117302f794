"""``bucket_size="auto"`` in a Tune run: measured where the buckets will run.

The pool sizes each structure once, before its first bucket opens, with
:func:`chorus_tune.capacity.auto_capacity`. The measurement must run on the
device the bucket will get (the pool holds no GPU), so it runs as a Ray task
asking for exactly a bucket's resources. ``max_calls=1`` makes its worker exit
afterwards: a reused worker would keep its CUDA context and cached blocks on
the card, memory the bucket that follows then lacks.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import ray
import ray.cloudpickle as cloudpickle

from chorus_tune.config_keys import users_config
from chorus_tune.tune.rules.resources import bucket_actor_options, bucket_threads, pick_device
from chorus_tune.tune.values.options import BucketOptions

if TYPE_CHECKING:  # the pool imports this module, and trial actors the pool's: no torch at import
    from chorus_tune.capacity import CapacityFit


def fit_summary(fit: "CapacityFit") -> dict[str, Any]:
    """The fit as plain values: the pool's stats and the ``chorus/capacity_fit`` result field."""
    return {"k": fit.k, "a": fit.a, "b": fit.b, "free_bytes": fit.free_bytes, "fraction": fit.fraction,
            "source": fit.source, "reason": fit.reason}


def _measure(task_blob: bytes, config: dict, fraction: float, cap: int | None,
             meter_factory: Callable[[Any], Any] | None, route: str, threads: int) -> "CapacityFit":
    import torch

    from chorus_tune.capacity import auto_capacity

    torch.set_num_threads(threads)
    task = cloudpickle.loads(task_blob)
    device = pick_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()).device
    meter = meter_factory(device) if meter_factory is not None else None
    return auto_capacity(task, config, device, fraction=fraction, cap=cap, meter=meter, route=route)


_measure_remote = ray.remote(max_calls=1)(_measure)


def needs_device(options: BucketOptions, per_bucket: dict[str, float]) -> bool:
    """Whether sizing must measure on a bucket's device; otherwise
    :func:`auto_capacity` returns the CPU default without measuring."""
    return per_bucket.get("GPU", 0) > 0 or options.memory_meter is not None


async def measure_bucket_size(task: Any, task_blob: bytes, config: dict, options: BucketOptions,
                              per_bucket: dict[str, float]) -> "CapacityFit":
    """The fit for members like ``config``: measured in a task holding a
    bucket's resources, or the CPU default at once when there is nothing to
    measure. Raises :class:`chorus_tune.capacity.CapacityFitError` when not
    even one member fits."""
    if not needs_device(options, per_bucket):
        from chorus_tune.capacity import auto_capacity

        return auto_capacity(task, config, "cpu", fraction=options.memory_fraction, cap=options.max_bucket_size)
    clean = users_config(config)
    return await _measure_remote.options(**bucket_actor_options(per_bucket)).remote(
        task_blob, clean, options.memory_fraction, options.max_bucket_size, options.memory_meter, options.route,
        bucket_threads(per_bucket))
