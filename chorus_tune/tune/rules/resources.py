"""How buckets and trials share a cluster's resources (Ray-free arithmetic).

A bucket does the work, a trial only talks to it. The rule (issue 40): **Ray's
view of the CPUs matches the cores the buckets compute on, and those cores are
held by the trials' tokens, not by the buckets.**

- ``resources_per_bucket`` says what one bucket uses. Default: one whole GPU
  (and one CPU for its thread) where the cluster has GPUs, otherwise one CPU:
  one bucket per core at most, and on a CPU-only machine the open buckets
  share every core of their node (the pool's ``set_threads``).
- GPUs and custom resources are *claimed* from Ray by the bucket actor. CPUs
  are not, so a bucket can always start. Claiming them fails under Tune's
  default search: Tune starts trials while any CPU is free, so the trials
  that wait for a bucket hold the CPU it would need (measured with one CPU
  per bucket, 8 trials in buckets of 4 on 2 CPUs: 4 trials failed after
  ``result_timeout_s`` waiting for a bucket that could not start; the other
  4 ran only once those had freed their CPU).
- The trials' tokens hold the buckets' cores instead (:func:`trial_token_cpu`):
  - under ``ChorusSearch``, which runs ``max_concurrent_trials`` trials at
    once, each asks for ``cores / max_concurrent_trials`` (at most one CPU, so
    it fits any node): ``cores`` is every CPU where the buckets share them
    (CPU-only, default resources), else the buckets' own CPUs;
  - under Tune's default search, which runs as many trials as fit, each asks
    for ``CPUs / slots``: Tune then runs about one trial per slot, and they
    hold every CPU. Trials beyond that stay PENDING in Tune (cheap) rather
    than as idle actors waiting for a slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

# Ray accounts resources in units of 1e-4.
_GRANULE = 1e-4
FALLBACK_TOKEN_CPU = 0.01


def default_bucket_resources(cluster: Mapping[str, float]) -> dict[str, float]:
    if cluster.get("GPU", 0) >= 1:
        return {"GPU": 1.0, "CPU": 1.0}
    return {"CPU": 1.0}


def bucket_resources(given, cluster: Mapping[str, float]) -> dict[str, float]:
    """What one bucket uses: ``given`` (a dict, or BucketOptions' pairs), else the default for ``cluster``."""
    return dict(given or default_bucket_resources(cluster))


def bucket_budget(cluster: Mapping[str, float], per_bucket: Mapping[str, float]) -> int:
    """How many buckets the cluster holds at once (at least one)."""
    fits = [math.floor(cluster.get(name, 0) / amount + 1e-9)
            for name, amount in per_bucket.items() if amount > 0]
    return max(1, min(fits)) if fits else 1


def spare_buckets(per_bucket: Mapping[str, float], capped: bool) -> int:
    """Buckets beyond :func:`bucket_budget` that a structure with none open
    may open (``Placement.spare``): one where buckets claim nothing from Ray
    (CPU-only, default resources: the open buckets share the cores) and the
    user set no ``max_buckets`` (``capped``); else none (a GPU bucket beyond
    the cards would wait in Ray for good).

    Why: a structure waiting for another's bucket to close started its own
    bucket process (about 4 s of imports and building on 2 cores) only then,
    and trained alone at the end while a core idled. Measured on the 4-width
    sweep (32 trials, 3 structures, 2 cores, chorus_tune alone, alternated,
    7 pairs): median 28.9 s with one spare (25.7-33.2), 32.7 s without
    (28.5-40.0), faster in 6 of the 7 pairs. Not more buckets
    of one structure: at 128 trials under ChorusASHA a third bucket of its
    one structure took 22.6 and 23.0 s against 22.3 and 19.8 s, its members
    spread thinner (mean live 6.3-8.7 against 9.9-10.5).
    """
    if capped:
        return 0
    claimed = bucket_actor_options(per_bucket)
    return 1 if not claimed["num_gpus"] and "resources" not in claimed else 0


def bucket_threads(per_bucket: Mapping[str, float]) -> int:
    return max(1, int(per_bucket.get("CPU", 1)))


def bucket_actor_options(per_bucket: Mapping[str, float]) -> dict:
    """``.options(...)`` for a bucket actor: claim GPUs and custom resources, not CPUs."""
    custom = {k: float(v) for k, v in per_bucket.items() if k not in ("CPU", "GPU") and v > 0}
    options: dict = {"num_cpus": 0, "num_gpus": float(per_bucket.get("GPU", 0))}
    if custom:
        options["resources"] = custom
    return options


def trial_token_cpu(cluster: Mapping[str, float], per_bucket: Mapping[str, float], bucket_size: int,
                    concurrency: int | None = None, shares_cores: bool = False) -> float:
    """The CPU a trial asks Tune for (see the module's rule).

    ``concurrency``: the trials a ChorusSearch runs at once, which then hold
    the cores the buckets compute on between them (``shares_cores``: the
    buckets share every CPU, as on a CPU-only cluster with default
    resources). ``None`` (Tune's default search): the cluster's CPUs shared
    out over every slot, so that Tune runs about one trial per slot.
    Never more than one CPU (a trial must fit a node), never zero (Tune
    refuses an all-zero request).
    """
    cpus = cluster.get("CPU", 0)
    if cpus <= 0:
        return FALLBACK_TOKEN_CPU
    if concurrency is None:
        share = cpus / (bucket_size * bucket_budget(cluster, per_bucket))
    else:
        share = bucket_cores(cluster, per_bucket, shares_cores) / max(1, concurrency)
    token = math.floor(share / _GRANULE + 1e-6) * _GRANULE
    return round(min(1.0, max(_GRANULE, token)), 4)


def bucket_cores(cluster: Mapping[str, float], per_bucket: Mapping[str, float], shares_cores: bool) -> float:
    """The cores the buckets compute on when all are open: every CPU where
    they share them, else their own CPUs (one thread per CPU, at least one)."""
    cpus = cluster.get("CPU", 0)
    if shares_cores:
        return cpus
    return min(cpus, bucket_budget(cluster, per_bucket) * bucket_threads(per_bucket))


@dataclass(frozen=True)
class DeviceChoice:
    """Where a bucket trains (docs/design.md D14).

    ``gpu_ids``: the ids of the GPUs Ray gave the bucket, as Ray names them on
    the bucket's own node. ``requested``: the torch device those ids mean in
    the bucket's process (``"cpu"`` without a GPU). ``device``: where it
    trains: ``requested``, or ``"cpu"`` where torch has no CUDA (a GPU
    declared to Ray on a machine without one, or a CPU build of torch).
    """

    requested: str
    device: str
    gpu_ids: tuple[str, ...] = ()

    @property
    def fell_back(self) -> bool:
        """Ray gave a GPU, but the bucket trains on the CPU."""
        return self.device != self.requested


def pick_device(gpu_ids: Sequence[object], cuda_visible_devices: str | None,
                cuda_available: bool) -> DeviceChoice:
    """The device of a bucket that Ray gave ``gpu_ids`` (``ray.get_gpu_ids()``).

    The index comes from this process alone, never from a count of buckets or
    GPUs, which would assume one node: it is the position of Ray's first id in
    ``CUDA_VISIBLE_DEVICES``. Ray sets that variable in each actor to the GPUs
    it assigned, so a bucket with one GPU trains on ``cuda:0``, its own card,
    whichever of the node's cards that is. Where the variable is unset (Ray
    told not to set it), torch sees every card of the node and Ray's id is the
    index. A bucket given several GPUs trains on the first.
    """
    ids = tuple(str(i) for i in gpu_ids)
    if not ids:
        return DeviceChoice("cpu", "cpu", ids)
    if cuda_visible_devices is None:
        index = int(ids[0])
    else:
        visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
        if ids[0] not in visible:
            raise ValueError(f"Ray gave this bucket GPU {ids[0]}, but CUDA_VISIBLE_DEVICES="
                             f"{cuda_visible_devices!r} hides it: was the variable overridden?")
        index = visible.index(ids[0])
    requested = f"cuda:{index}"
    return DeviceChoice(requested, requested if cuda_available else "cpu", ids)


def shared_threads(node_cpus: Mapping[str, float], bucket_nodes: Mapping[str, str | None]) -> dict[str, int]:
    """Threads for each bucket that shares its node's cores (CPU-only default resources).

    ``node_cpus``: each node's CPUs; ``bucket_nodes``: where each bucket runs
    (``None`` while it starts). The buckets on one node share that node's
    cores, never the cluster's: two buckets on a 2-core node get one thread
    each, however many cores other nodes have. A bucket whose node is not
    known yet is left out (it keeps the threads it started with).
    """
    by_node: dict[str, list[str]] = {}
    for bucket, node in bucket_nodes.items():
        if node is not None and node in node_cpus:
            by_node.setdefault(node, []).append(bucket)
    return {bucket: max(1, int(node_cpus[node]) // len(buckets))
            for node, buckets in by_node.items() for bucket in buckets}


def training_buckets(buckets: Iterable[str], has_members: Callable[[str], bool]) -> list[str]:
    """The buckets that share their node's cores (:func:`shared_threads`):
    those with members to train, or all of them when none has. A bucket whose
    members have all finished waits only for its trials to read it; a thread
    it kept would sit idle beside a bucket still training."""
    buckets = list(buckets)
    return [b for b in buckets if has_members(b)] or buckets
