"""The same sweep three ways: plain Ray Tune, chorus_tune, and the raw fused loop.

(a) plain   Ray Tune as a user runs it today: a function trainable training one
            model with ``chorus_tune.reference`` (stock ``torch.optim``),
            ``reuse_actors=True``, one CPU per trial (so every core runs a
            trial). On CUDA, as GPU users run it:
            ``tune.with_resources(train_fn, {"cpu": 1, "gpu": f})`` with
            ``--gpu-fraction f``, so 1/f trials share the card; on a CPU the
            same fraction of the machine's cores instead. Several fractions
            (``--gpu-fraction 0.25,0.125,0.0625``) run as ways ``plain@f`` and
            the row's (a) is the fastest of them: plain Tune at its best share.
            The data: workloads made on the device (``workloads.SIZED``) are
            made once per trial process, where it trains, and kept across the
            trials that process serves; the others are built once by the
            driver and reach every trial through the object store
            (``tune.with_parameters``).
(b) chorus  ``ChorusTrainable`` + ``ChorusSearch(task=trainable)``, written the
            Tune way: a stop dict ``RunConfig(stop={"training_iteration": n})``
            and no ``max_iterations``; the same configs, seeds and epochs.
            ``--max-iterations-column`` adds a way ``chorus-maxit`` that also
            passes ``ChorusSearch(max_iterations=n)`` (FIFO rows only).
(b0) lockstep  ``run_ahead=0`` with a trial process per slot, as chorus_tune
            ran before members trained ahead of their trials.
(c) fused   the core's ``Bucket`` over the same members with no Ray at all,
            pruning each cohort at the same rungs as synchronous successive
            halving (what ChorusASHA decides for a full cohort), as many
            buckets at once as (b) runs, always in spawned processes (their
            start-up counted, as (b)'s bucket actors' is), each with the torch
            threads a bucket of (b) gets: the ceiling for (b).
floor       Tune's own floor (way ``floor``, not run by default): a no-op function
            trainable under (a)'s search, scheduler, stop dict and resources,
            reporting a metric its config alone decides (so a scheduler prunes
            it as it prunes (a): about as many results), and nothing else: what
            the sweep costs in Tune's own work per trial and per result. Beside (b)'s ms per queued result,
            its own says what reading a result costs over Tune's handling of it.

Schedulers (``--scheduler`` or the rows of ``--rows``): ``fifo`` (Tune's
default), ``asha`` (stock ``ASHAScheduler`` in (a), ``ChorusASHA`` in (b)),
``stock-asha`` (stock ``ASHAScheduler(max_t=n, grace_period=1,
reduction_factor=4)`` on both sides). Every row runs both Tune sides with a
stop dict. Under ``stock-asha`` (c) still halves whole cohorts (it is the
ceiling of what the bucket could do, not a replay of stock ASHA's
promotions): compare the member-epochs each side trained.

Fairness (issue 22): before every timed run the script waits until the
cluster's resources are all free and every bucket of the previous run has
closed (``settle_s`` records how long); each way gets ``--warmup`` discarded
runs first; then ``--repeats`` runs of every row, interleaved across rows
and ways, the ways' order rotated from run to run. Every Tune run records
its timeline (``fit()`` to the first result, to the last), and the member-
epochs it trained: (a) the sum of ``training_iteration`` over its trials,
(b) those plus ``chorus/wasted`` (computed, never read), (c) what it
trained; seconds per member-epoch stand beside the wall-time ratio.

Printed and written (JSON, Markdown table, PNG): median wall time, trials per
minute (not for a run that hit its time budget), best final ``val_accuracy``,
the ratios (a)/(b) and (b)/(c), and (b)-(c) split into start-up and the rest.
The JSON is rewritten after every run, so a run cut short keeps what finished.
``--way-budget-s`` gives each ``Tuner.fit`` Tune's ``time_budget_s``: a way
that hits it is marked ``budget_hit`` (its time is then a lower bound).

    .venv/bin/python benchmarks/vs_tune.py --workload synth-mlp64 --trials 32 --epochs 10 --bucket-size 16
    .venv/bin/python benchmarks/vs_tune.py --workload synth-mlp64 --ways plain,chorus,fused \\
        --rows asha:10:16,fifo:10:16,fifo:10:32,fifo:40:16,fifo:40:32,asha:10:32,stock-asha:10:16
    python3 benchmarks/vs_tune.py --device cuda --workload cifar-cnn3 --trials 64 --epochs 2 \\
        --scheduler fifo,asha --ways plain,chorus --gpu-fraction 0.25,0.125,0.0625   # on a GPU (gpu_check.sh)
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chorus_tune as ct  # noqa: E402
from chorus_tune.reference import ReferenceRun  # noqa: E402

import workloads  # noqa: E402  (after the path tweak: benchmarks/ is not a package)

METRIC, MODE = "val_accuracy", "max"
SCHEDULERS = ("fifo", "asha", "stock-asha")
WAYS = ("plain", "chorus", "chorus-maxit", "lockstep", "fused", "floor")
TUNE_WAYS_CHORUS = ("chorus", "chorus-maxit", "lockstep")


@dataclass
class Outcome:
    """One timed run of one way."""

    way: str
    wall_s: float
    trials: int
    best: float
    reached_max_t: int
    budget_hit: bool = False
    member_epochs: int = 0  # trained: (a) read = trained; (b) read + wasted; (c) trained
    wasted: int = 0  # (b): member-epochs computed that no trial read (chorus/wasted)
    first_result_s: float | None = None  # start to the first result (Tune: fit() to the first report)
    mean_live: float | None = None  # (b): mean chorus/live over the fused iterations Tune read results of
    mean_rows: float | None = None  # (b): mean chorus/rows (rows computed) over the same iterations
    last_result_s: float | None = None  # start to the last result
    # Mean ms from the result Tune received last (any trial) to each result that
    # was computed before its trial asked for it (its trial's last result said
    # chorus/ahead >= 1; the floor computes nothing: every result) and is not its
    # trial's first (that one waits for the trial to start and join): what one
    # result costs to read, Tune's driver included. None for (a): it trains in step.
    read_ms: float | None = None
    settle_s: float = 0.0  # waited before the run for the cluster to be free again
    settled: bool = True  # False: the wait timed out (the run shared the machine with leftovers)
    threads: int | None = None  # (c): torch threads per process
    configs_digest: str = ""  # the configs it trained (the same on every way, or the sides differ)
    repeat: int = 0  # 0: a warm-up (discarded)
    # (b): the buckets this run opened, how many of them were solo (a member its trial
    # trained, no bucket actor), and their median seconds from opening to started.
    buckets: int | None = None
    buckets_solo: int | None = None
    bucket_start_s: float | None = None

    @property
    def trials_per_min(self) -> float | None:
        """None for a run cut by its time budget: its trials did not all finish."""
        return None if self.budget_hit else 60.0 * self.trials / self.wall_s

    @property
    def s_per_member_epoch(self) -> float | None:
        return self.wall_s / self.member_epochs if self.member_epochs else None


@dataclass(frozen=True)
class RowSpec:
    """One row of the table: a workload, a scheduler, its epochs (max_t) and a bucket size."""

    workload: str
    scheduler: str
    epochs: int
    bucket_size: int

    @property
    def label(self) -> str:
        return f"{self.workload} {self.scheduler} {self.epochs} ep, bucket {self.bucket_size}"


def parse_rows(text: str, names: Sequence[str]) -> list[RowSpec]:
    """``--rows``: ``scheduler:epochs:bucket`` items, comma-separated, each for every
    workload in ``names`` (workload-major: one workload's rows, then the next's)."""
    specs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in SCHEDULERS:
            raise ValueError(f"a row is scheduler:epochs:bucket with scheduler in {SCHEDULERS}; got {item!r}")
        epochs, bucket = int(parts[1]), int(parts[2])
        if epochs < 1 or bucket < 1:
            raise ValueError(f"epochs and bucket size must be at least 1; got {item!r}")
        specs.append((parts[0], epochs, bucket))
    return [RowSpec(name, s, e, b) for name in names for s, e, b in specs]


def matrix_rows(names: Sequence[str], schedulers: Sequence[str], sizes: Sequence[int], epochs: int,
                asha_epochs: int | None) -> list[RowSpec]:
    """The rows of the ``--scheduler`` x ``--workload`` x ``--bucket-size`` matrix."""
    return [RowSpec(name, s, asha_epochs if s != "fifo" and asha_epochs else epochs, size)
            for s in schedulers for name in names for size in sizes]


def expand_ways(ways: Sequence[str], fractions: Sequence[float] | None) -> list[str]:
    """``plain`` becomes ``plain@f`` for each of several card fractions (one: stays ``plain``)."""
    out = []
    for way in ways:
        if way == "plain" and fractions and len(fractions) > 1:
            out += [f"plain@{f:g}" for f in fractions]
        else:
            out.append(way)
    return out


def way_kind(way: str) -> str:
    """``plain@0.25`` -> ``plain``."""
    return way.split("@", 1)[0]


def rotated(ways: Sequence[str], turn: int) -> list[str]:
    """The ways in the order of run ``turn``: rotated by one each run, so no way always
    goes first (and pays the machine's cold caches) or always follows the same one."""
    if not ways:
        return []
    k = turn % len(ways)
    return list(ways[k:]) + list(ways[:k])


def runs_on(way: str, row: RowSpec) -> bool:
    """Whether ``way`` runs on ``row``: ``chorus-maxit`` only on FIFO rows (elsewhere it
    would be ``chorus`` again: max_iterations says FIFO)."""
    return way != "chorus-maxit" or row.scheduler == "fifo"


def schedule(rows: Sequence[RowSpec], ways: Sequence[str], repeats: int, warmup: int) -> list[tuple[int, int, str]]:
    """Every run of the invocation, in order: ``(repeat, row index, way)``; repeat 0 is
    a warm-up. The warm-ups run first, ``warmup`` per way, on each workload's first row
    (its process caches, imports and data are what a cold start pays). Then repeat 1
    of every row, repeat 2 of every row, ...: interleaved, so a drifting load hits
    rows and ways alike and a run cut short has whole repeats. Within a row the ways
    are rotated by ``repeat + row index``."""
    runs = []
    first_of = {}
    for i, row in enumerate(rows):
        first_of.setdefault(row.workload, i)
    for i in first_of.values():
        for w in range(warmup):
            runs += [(0, i, way) for way in rotated(ways, w)]
    for r in range(1, repeats + 1):
        for i, row in enumerate(rows):
            runs += [(r, i, way) for way in rotated([w for w in ways if runs_on(w, row)], r - 1 + i)]
    return runs


# ----- the sweep ---------------------------------------------------------------------------------
@dataclass
class Sweep:
    """What every way trains: Tune's ``param_space`` (and ``num_samples``), and the same
    configs listed in the order ChorusSearch seats them, for (c)."""

    param_space: dict
    configs: list[dict]
    num_samples: int  # what plain Tune's TuneConfig gets (1 for a grid: the grid is the sweep)
    random_state: int | None = None  # a random space: sampled with this seed on both sides


def sweep(trials: int) -> dict:
    """``trials`` configs: a learning-rate axis times a weight-decay axis, seed 0 for all."""
    n_wd = 4 if trials % 4 == 0 else 1
    n_lr = trials // n_wd
    lrs = [round(0.003 * (100 ** (i / max(1, n_lr - 1))), 6) for i in range(n_lr)]  # 0.003 .. 0.3
    wds = [0.0, 1e-4, 1e-3, 1e-2][:n_wd]
    return {"lr": lrs, "weight_decay": wds, "momentum": 0.9, "seed": 0}


def configs_of(space: dict) -> list[dict]:
    """The sweep's configs in Tune's grid order (the first axis varies fastest): (c)'s
    blocks of ``bucket_size`` are then the groups ChorusSearch releases together in (b)."""
    return [dict(lr=lr, weight_decay=wd, momentum=space["momentum"], seed=space["seed"])
            for wd in space["weight_decay"] for lr in space["lr"]]


def tune_space(space: dict) -> dict:
    from ray import tune

    return {"lr": tune.grid_search(space["lr"]), "weight_decay": tune.grid_search(space["weight_decay"]),
            "momentum": space["momentum"], "seed": space["seed"]}


def sample_configs(param_space: dict, n: int, random_state: int) -> list[dict]:
    """``n`` configs drawn from a random ``param_space`` exactly as ChorusSearch's sampler
    (and Tune's default generator with that ``random_state``) draws them."""
    from chorus_tune.tune.search.search import SpaceSampler

    sampler = SpaceSampler(random_state)
    sampler.set_search_properties(METRIC, MODE, param_space)
    return [sampler.suggest(str(i)) for i in range(n)]


def make_sweep(workload: str, trials: int) -> Sweep:
    """The grid of :func:`sweep`, a workload's own grid (``workloads.GRIDS``: one pass is
    the sweep, ``trials`` aside), or its own random space (``workloads.SPACES``)."""
    if workload in workloads.GRIDS:
        space = workloads.GRIDS[workload]()
        from chorus_tune.tune.search.search import grid_size

        return Sweep(space, sample_configs(space, grid_size(space), 0), 1)
    if workload in workloads.SPACES:
        space = workloads.SPACES[workload]()
        return Sweep(space, sample_configs(space, trials, 0), trials, random_state=0)
    grid = sweep(trials)
    return Sweep(tune_space(grid), configs_of(grid), 1)


def configs_digest(configs: Sequence[Mapping], keys: Sequence[str]) -> str:
    """A short digest of the multiset of configs (their ``keys``, floats to 9 digits):
    equal digests on two ways mean both trained the same sweep. A trial that never
    started (the run hit its time budget first) has no config: it counts as empty."""
    def cell(v: Any) -> Any:
        return float(f"{v:.9g}") if isinstance(v, float) else v
    rows = sorted(json.dumps([cell((c or {}).get(k)) for k in keys], default=str) for c in configs)
    return hashlib.sha1("\n".join(rows).encode()).hexdigest()[:12]


def best_final(results, max_t: int) -> tuple[float, int]:
    """Best final metric over the trials, and how many trials reached ``max_t``."""
    finals = [r.metrics for r in results if r.metrics and METRIC in r.metrics]
    best = max((m[METRIC] for m in finals if not math.isnan(m[METRIC])), default=float("nan"))
    return best, sum(1 for m in finals if m.get("training_iteration") == max_t)


# ----- between runs ------------------------------------------------------------------------------
_UNHELD = ("memory", "object_store_memory")  # move with the objects stored, not with who runs


def resources_free(total: Mapping[str, float], available: Mapping[str, float], tolerance: float = 1e-3) -> bool:
    """Every resource Ray accounts (CPUs, GPUs, custom ones) is available again."""
    return all(available.get(k, 0.0) >= v - tolerance for k, v in total.items() if k not in _UNHELD)


def buckets_closed(stats: Mapping[str, Mapping]) -> bool:
    """Every bucket the pool opened has closed (or died). A CPU-only bucket asks Ray
    for nothing, so free resources alone do not say that its process is gone."""
    return all(entry.get("closed") for entry in stats.values())


def settle(timeout_s: float, poll_s: float = 0.2) -> tuple[float, bool]:
    """Wait until the cluster's resources are all free and every bucket has closed
    (buckets close ``idle_close_s`` after their last read, holding a GPU until then:
    the next timed run must not wait for them inside its own time). The last
    run's idle buckets are told to close now (``close_idle_buckets``), as a
    script that needs the device next would: waiting out their ``idle_close_s``
    only idled the machine between runs. Returns the seconds waited, and whether
    it settled before ``timeout_s``."""
    import ray

    from chorus_tune.tune.client import bucket_stats, close_idle_buckets

    start = time.perf_counter()
    close_idle_buckets()
    while True:
        if resources_free(ray.cluster_resources(), ray.available_resources()) and buckets_closed(bucket_stats()):
            return time.perf_counter() - start, True
        if time.perf_counter() - start > timeout_s:
            return time.perf_counter() - start, False
        time.sleep(poll_s)


def make_timeline(all_queued: bool = False):
    """A Tune callback (in the driver) that records when results arrive and the most
    ``chorus/wasted`` each bucket reported: the run's start-up is ``fit()`` to the
    first result, what follows is training and Tune's driver. ``all_queued``: every
    result counts as computed before it was asked for (the floor's no-op trainable)."""
    from ray import tune

    class Timeline(tune.Callback):
        def __init__(self) -> None:
            self.first: float | None = None
            self.last: float | None = None
            self.results = 0
            self.all_queued = all_queued
            self._ahead: dict[str, int] = {}  # trial -> chorus/ahead of its last result
            self.gaps: list[float] = []
            self.wasted: dict[str, int] = {}
            # (bucket, bucket iteration) -> (chorus/live, chorus/rows) of the fused
            # iteration that computed a result Tune received.
            self.iterations: dict[tuple[str, int], tuple[int, int]] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
            now = time.perf_counter()
            before = self._ahead.get(trial.trial_id)  # None: the trial's first result
            if before is not None and (self.all_queued or before >= 1) and self.last is not None:
                self.gaps.append(now - self.last)
            ahead = result.get("chorus/ahead")
            self._ahead[trial.trial_id] = int(ahead) if isinstance(ahead, (int, float)) else 0
            self.first = now if self.first is None else self.first
            self.last = now
            self.results += 1
            bucket, wasted = result.get("chorus/bucket"), result.get("chorus/wasted")
            if bucket is not None and isinstance(wasted, (int, float)):
                self.wasted[bucket] = max(self.wasted.get(bucket, 0), int(wasted))
            if bucket is not None and result.get("chorus/live") is not None:
                live = int(result["chorus/live"])
                rows = int(result.get("chorus/rows") or result.get("chorus/capacity") or live)
                self.iterations[(bucket, int(result["chorus/bucket_iteration"]))] = (live, rows)

        def read_ms(self) -> float | None:
            """Mean ms to each result computed before it was asked for (see Outcome.read_ms)."""
            return 1000 * statistics.mean(self.gaps) if self.gaps else None

        def mean_live(self) -> tuple[float | None, float | None]:
            """Mean members trained, and mean rows computed, per fused iteration
            whose results Tune received."""
            if not self.iterations:
                return None, None
            lives, rows = zip(*self.iterations.values())
            return statistics.mean(lives), statistics.mean(rows)

    return Timeline()


def wasted_total(from_results: Mapping[str, int], stats: Mapping[str, Mapping]) -> int:
    """Member-epochs computed that no trial read, over the run's buckets: per bucket the
    larger of the last ``chorus/wasted`` a result carried and what the pool reads from
    it after the run (a member that leaves after its trial's last read adds its unread
    results then)."""
    names = set(from_results) | set(stats)
    return sum(max(int(from_results.get(n, 0)), int(stats.get(n, {}).get("wasted") or 0)) for n in names)


# ----- the ways ----------------------------------------------------------------------------------
def plain_resources(args) -> dict:
    """(a)'s request per trial: one CPU, or with ``--gpu-fraction f`` a fraction f of the
    card (and one CPU) on CUDA, f of the machine's cores on a CPU."""
    if args.gpu_fraction is None:
        return {"cpu": 1, "gpu": 1.0 / 16} if args.device == "cuda" else {"cpu": 1}
    if args.device == "cuda":
        return {"cpu": 1, "gpu": args.gpu_fraction}
    return {"cpu": round(max(0.01, args.gpu_fraction * (os.cpu_count() or 1)), 4)}


def scheduler_for(kind: str, scheduler: str, epochs: int, reduction_factor: float):
    """The row's scheduler for a side: none (FIFO), stock ASHA, or ChorusASHA ((b) under ``asha``)."""
    if scheduler == "fifo":
        return None
    if scheduler == "stock-asha" or kind == "plain":
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=reduction_factor)
    from chorus_tune import ChorusASHA

    return ChorusASHA(max_t=epochs, grace_period=1, reduction_factor=reduction_factor)


def plain_tune_config(sw: Sweep, args):
    """The TuneConfig of plain Tune's sides (ways plain and floor). A random space:
    Tune's default generator, seeded as (b)'s sampler is, so both sides draw the
    same configs (the digest in the JSON checks it)."""
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    search = None if sw.random_state is None else BasicVariantGenerator(random_state=sw.random_state)
    return tune.TuneConfig(metric=METRIC, mode=MODE, reuse_actors=True, search_alg=search,
                           num_samples=sw.num_samples,
                           scheduler=scheduler_for("plain", args.scheduler, args.epochs, args.reduction_factor),
                           time_budget_s=args.way_budget_s)


def run_plain(task: ct.Task, sw: Sweep, args) -> Outcome:
    from ray import tune

    device = args.device
    threads = 1
    epochs = args.epochs
    per_process = args.workload in workloads.SIZED

    def train_one(config: dict, task: ct.Task = None) -> None:
        torch.set_num_threads(threads)
        if per_process:
            # Made on this process's device once, kept for every trial it serves.
            cache = workloads.process_cache()
            key = getattr(task.data, "__qualname__", repr(task.data))
            if key not in cache:
                cache[key] = task.load_data()
            task._loaded = cache[key]
        run = ReferenceRun(task, config, device=device)
        for _ in range(epochs):
            metrics = run.run_iteration()
            tune.report({k: v for k, v in metrics.items() if k != "route"})

    resources = plain_resources(args)
    if not per_process:
        # The data is built once, here, and reaches every trial through the object
        # store (tune.with_parameters), as a careful Tune user ships a dataset.
        task = dataclasses.replace(task, data=task.data() if callable(task.data) else task.data)
    trainable = tune.with_resources(tune.with_parameters(train_one, task=task), resources)
    return fit_timed(args.way, trainable, plain_tune_config(sw, args), sw, args)


def fit_timed(way: str, trainable, tune_config, sw: Sweep, args) -> Outcome:
    """Time one ``Tuner.fit`` of the sweep, with a stop dict on every side (the Tune way)."""
    from ray import tune

    from chorus_tune.tune.client import bucket_stats

    timeline = make_timeline(all_queued=way_kind(way) == "floor")
    # The driver's pool outlives a run and lists every bucket it ever opened:
    # only this run's buckets count for its waste.
    before = set(bucket_stats()) if way_kind(way) in TUNE_WAYS_CHORUS else set()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable, param_space=sw.param_space, tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": args.epochs}, verbose=0,
                                      callbacks=[timeline]),
        )
        results = tuner.fit()
        wall = time.perf_counter() - start
        # Read now, while the run's buckets are still open (they close idle_close_s later).
        stats = ({n: s for n, s in bucket_stats().items() if n not in before}
                 if way_kind(way) in TUNE_WAYS_CHORUS else {})
    best, reached = best_final(results, args.epochs)
    hit = args.way_budget_s is not None and wall >= args.way_budget_s
    read = sum(int(r.metrics.get("training_iteration", 0)) for r in results if r.metrics)
    wasted = wasted_total(timeline.wasted, stats)
    keys = list(sw.configs[0]) if sw.configs else []
    mean_live, mean_rows = timeline.mean_live()
    starts = [entry["start_s"] for entry in stats.values()
              if entry.get("start_s") is not None and not entry.get("solo")]
    return Outcome(way, wall, len(results), best, reached, hit, member_epochs=read + wasted, wasted=wasted,
                   buckets=len(stats) if stats else None,
                   buckets_solo=sum(1 for entry in stats.values() if entry.get("solo")) if stats else None,
                   bucket_start_s=statistics.median(starts) if starts else None,
                   mean_live=mean_live, mean_rows=mean_rows, read_ms=timeline.read_ms(),
                   first_result_s=None if timeline.first is None else timeline.first - start,
                   last_result_s=None if timeline.last is None else timeline.last - start,
                   configs_digest=configs_digest([r.config for r in results], keys))


def run_chorus(task: ct.Task, sw: Sweep, args, lockstep: bool = False) -> Outcome:
    """(b) written the Tune way: ``ChorusSearch(task=trainable)``, the run's stop dict,
    no ``max_iterations`` (way ``chorus-maxit``: with it, FIFO rows only).
    ``lockstep``: (b0), ``run_ahead=0`` with a trial process per slot."""
    from ray import tune

    from chorus_tune import ChorusSearch, ChorusTrainable

    trainable = ChorusTrainable.for_task(task, bucket_size=args.bucket_size, max_buckets=args.max_buckets,
                                         run_ahead=0 if lockstep else 2)
    search = ChorusSearch(
        task=trainable, random_state=sw.random_state,
        max_iterations=args.epochs if args.way == "chorus-maxit" and args.scheduler == "fifo" else None,
        max_concurrent_trials=args.bucket_size * fused_parallelism(args, len(sw.configs)) if lockstep else None)
    tune_config = tune.TuneConfig(
        # With a Searcher, Tune's num_samples counts every trial (not passes over the grid).
        metric=METRIC, mode=MODE, search_alg=search, num_samples=len(sw.configs),
        reuse_actors=True,  # as (a): a pruned trial's actor serves the next trial
        scheduler=scheduler_for("chorus", args.scheduler, args.epochs, args.reduction_factor),
        time_budget_s=args.way_budget_s)
    return fit_timed(args.way, trainable, tune_config, sw, args)


def run_lockstep(task: ct.Task, sw: Sweep, args) -> Outcome:
    return run_chorus(task, sw, args, lockstep=True)


def make_task(workload: str, batch_size: int, n_train: int | None = None, n_val: int | None = None) -> ct.Task:
    """The task of a named workload. Its data stays a callable: each bucket (and each
    (c) process) builds it once, so it never travels inside the trainable class to
    every trial actor. ``n_train``/``n_val`` size the workloads in ``workloads.SIZED``."""
    model, data = workloads.workload(workload, n_train, n_val)
    return ct.Task(model, data, optimizer="sgd", batch_size=batch_size)


def fused_block(workload: str, batch_size: int, device: str, configs: list[dict], epochs: int,
                rungs: set, reduction_factor: float, n_train: int | None = None,
                n_val: int | None = None, threads: int = 1) -> tuple[float, int, int, float | None]:
    """(c) for one bucket's worth of configs, in a process of its own: the best final
    metric, how many reached the end, the member-epochs trained, and the wall-clock
    time (``time.time()``) its first epoch ended."""
    torch.set_num_threads(threads)  # what a bucket of (b) gets (fused_threads)
    from chorus_tune.tune.rules.halving import select_survivors

    bucket = ct.Bucket(make_task(workload, batch_size, n_train, n_val), len(configs), device=device)
    for config in configs:
        bucket.add(config)
    member_epochs, first = 0, None
    for epoch in range(1, epochs + 1):
        results = bucket.run_iteration()
        member_epochs += len(results)
        first = time.time() if first is None else first
        if epoch == epochs:
            finals = [m[METRIC] for m in results.values() if not math.isnan(m[METRIC])]
            return max(finals, default=float("nan")), len(results), member_epochs, first
        if epoch in rungs:
            keep = set(select_survivors({str(s): m[METRIC] for s, m in results.items()}, reduction_factor))
            for slot in results:
                if str(slot) not in keep:
                    bucket.retire(slot)
            if 2 * len(bucket.live_slots) <= bucket.capacity:
                bucket.compact()
    return float("nan"), 0, member_epochs, first


def fused_parallelism(args, blocks: int) -> int:
    """How many buckets (b) trains at once by default: one per GPU, else one per core
    (never more than there are blocks of configs)."""
    if args.max_buckets:
        return args.max_buckets
    if args.device == "cuda":
        return max(1, torch.cuda.device_count())
    return max(1, min(os.cpu_count() or 1, blocks))


def fused_threads(device: str, parallel: int, cpus: int) -> int:
    """The torch threads each (c) process gets: what a bucket of (b) gets. On a GPU a
    bucket runs one thread (its default resources, one CPU); on a CPU-only machine
    the open buckets share the node's cores (the pool's rule, ``shared_threads``)."""
    from chorus_tune.tune.rules.resources import bucket_threads, shared_threads

    if device == "cuda":
        return bucket_threads({})
    return shared_threads({"node": cpus}, {str(i): "node" for i in range(parallel)})["0"]


def fused_blocks(task: ct.Task, configs: Sequence[dict], bucket_size: int) -> list[list[dict]]:
    """The configs in buckets as the pool seats them: by sharing key (widths the
    width rule lets share pad into one stack, docs/design.md D9; the rest split),
    each key's in seating order, ``bucket_size`` at a time."""
    from chorus_tune.stack import sharing_key
    from chorus_tune.width_rule import WidthGroups

    widths = WidthGroups()  # on a CPU, as the pool's for CPU buckets
    groups: dict[Any, list[dict]] = {}
    for config in configs:
        groups.setdefault(sharing_key(task, config, widths), []).append(config)
    return [group[i:i + bucket_size] for group in groups.values() for i in range(0, len(group), bucket_size)]


def run_fused(task: ct.Task, sw: Sweep, args) -> Outcome:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from chorus_tune.tune.rules.halving import rung_milestones

    rungs = set(rung_milestones(1, args.epochs, args.reduction_factor)) if args.scheduler != "fifo" else set()
    blocks = fused_blocks(task, sw.configs, args.bucket_size)
    parallel = fused_parallelism(args, len(blocks))
    threads = fused_threads(args.device, parallel, os.cpu_count() or 1)
    jobs = [(args.workload, args.batch_size, args.device, block, args.epochs, rungs, args.reduction_factor,
             args.n_train, args.n_val, threads) for block in blocks]
    start, start_clock = time.perf_counter(), time.time()
    # Always spawned, however many buckets (b) runs: each process's start-up is counted,
    # as (b)'s bucket actors' is, and no row runs in the already-warm driver.
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        outcomes = list(pool.map(fused_block, *zip(*jobs)))
    wall = time.perf_counter() - start
    finals = [b for b, *_ in outcomes if not math.isnan(b)]
    firsts = [f for *_, f in outcomes if f is not None]
    keys = list(sw.configs[0]) if sw.configs else []
    return Outcome("fused", wall, len(sw.configs), max(finals, default=float("nan")),
                   sum(o[1] for o in outcomes), member_epochs=sum(o[2] for o in outcomes),
                   first_result_s=min(firsts) - start_clock if firsts else None,
                   last_result_s=wall, threads=threads, configs_digest=configs_digest(sw.configs, keys))


def _config_score(config: dict) -> float:
    """A score in [0, 1) that only ``config`` decides (no torch, no clock): the floor's metric."""
    digest = hashlib.sha256(repr(sorted(config.items())).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def run_floor(task: ct.Task, sw: Sweep, args) -> Outcome:
    """Tune's own floor: a no-op function trainable under (a)'s search, scheduler,
    stop dict and resources, its metric decided by its config alone. Its ms per
    result (``read_ms``) is what Tune itself takes to handle one."""
    from ray import tune

    epochs = args.epochs

    def report_only(config: dict) -> None:
        # A value of the config alone, the same at every iteration: a scheduler
        # ranks the trials and prunes as many as it would in (a) (a constant
        # let stock ASHA continue every trial to max_t: 16 results a trial
        # where (a) reads about 2 at 128 trials).
        value = _config_score(config)
        for _ in range(epochs):
            tune.report({METRIC: value})

    trainable = tune.with_resources(report_only, plain_resources(args))
    return fit_timed(args.way, trainable, plain_tune_config(sw, args), sw, args)


RUNNERS: dict[str, Callable[..., Outcome]] = {"plain": run_plain, "chorus": run_chorus, "chorus-maxit": run_chorus,
                                              "lockstep": run_lockstep, "fused": run_fused, "floor": run_floor}


def way_args(args, way: str, spec: RowSpec | None = None) -> argparse.Namespace:
    """The arguments one run of ``way`` (on row ``spec``) sees: its card fraction
    (``plain@f``: f; else the only one given, or None) and the row's settings."""
    fraction = float(way.split("@", 1)[1]) if "@" in way else (args.gpu_fractions or [None])[0]
    row = {} if spec is None else {"workload": spec.workload, "bucket_size": spec.bucket_size,
                                   "scheduler": spec.scheduler, "epochs": spec.epochs}
    return argparse.Namespace(**{**vars(args), **row, "way": way, "gpu_fraction": fraction})


def run_way(way: str, spec: RowSpec, task: ct.Task, sw: Sweep, args) -> Outcome:
    """One run of ``way`` on row ``spec``."""
    return RUNNERS[way_kind(way)](task, sw, way_args(args, way, spec))


# ----- the report --------------------------------------------------------------------------------
def plot(rows: list[dict], path: str) -> bool:
    """One group of bars (each way's median wall time) per row; False where matplotlib
    is missing (the GPU machine's stock image has none: the JSON holds everything)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = list(dict.fromkeys(w for row in rows for w in row["median_wall_s"]))
    palette = ["#888", "#2a7", "#7a2", "#a72", "#27a", "#a27", "#555", "#bbb"]
    width = 0.8 / len(ways)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 3.8))
    for j, way in enumerate(ways):
        xs = [i + (j - (len(ways) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [row["median_wall_s"].get(way, 0.0) for row in rows], width, label=way,
               color=palette[j % len(palette)])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{row['workload']}\nbucket {row['bucket_size']}\n{row['scheduler']} {row['epochs']}"
                        for row in rows], fontsize=7)
    ax.set_ylabel("wall time, s (median)")
    ax.set_title(f"{rows[0]['trials']} trials, {rows[0]['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarise(row: dict, outcomes: dict[str, list[Outcome]]) -> dict:
    """The row's medians, bests and ratios from the timed runs so far (warm-ups excluded)."""
    done = {w: outs for w, outs in outcomes.items() if outs}
    median = {w: statistics.median(o.wall_s for o in outs) for w, outs in done.items()}
    hit = {w: any(o.budget_hit for o in outs) for w, outs in done.items()}
    per_me = {w: _median([o.s_per_member_epoch for o in outs]) for w, outs in done.items()}
    row.update(
        median_wall_s=median,
        # A run cut by its time budget did not finish its trials: no rate from their count.
        trials_per_min={w: (None if hit[w] else 60.0 * row["trials"] / s) for w, s in median.items()},
        best={w: max(o.best for o in outs) for w, outs in done.items()},
        budget_hit=hit,
        member_epochs={w: _median([o.member_epochs for o in outs]) for w, outs in done.items()},
        wasted={w: _median([o.wasted for o in outs]) for w, outs in done.items() if way_kind(w) in TUNE_WAYS_CHORUS},
        s_per_member_epoch=per_me,
        mean_live={w: _median([o.mean_live for o in outs]) for w, outs in done.items()
                   if way_kind(w) in TUNE_WAYS_CHORUS},
        mean_rows={w: _median([o.mean_rows for o in outs]) for w, outs in done.items()
                   if way_kind(w) in TUNE_WAYS_CHORUS},
        first_result_s={w: _median([o.first_result_s for o in outs]) for w, outs in done.items()},
        buckets={w: _median([o.buckets for o in outs]) for w, outs in done.items() if way_kind(w) in TUNE_WAYS_CHORUS},
        bucket_start_s={w: _median([o.bucket_start_s for o in outs]) for w, outs in done.items()
                        if way_kind(w) in TUNE_WAYS_CHORUS},
        read_ms={w: _median([o.read_ms for o in outs]) for w, outs in done.items()},
        settle_s={w: max(o.settle_s for o in outs) for w, outs in done.items()},
        unsettled_runs=sum(1 for outs in done.values() for o in outs if not o.settled),
        same_configs=len({o.configs_digest for outs in done.values() for o in outs}) <= 1,
        runs={w: [dict(asdict(o), trials_per_min=o.trials_per_min, s_per_member_epoch=o.s_per_member_epoch)
                  for o in outs] for w, outs in done.items()},
    )
    plains = [w for w in median if way_kind(w) == "plain"]
    if plains:
        row["plain_way"] = plain = min(plains, key=lambda w: median[w])  # plain Tune at its best share
    for key, (a, b) in {"plain_over_chorus": ("plain", "chorus"), "chorus_over_fused": ("chorus", "fused"),
                        "plain_over_lockstep": ("plain", "lockstep"),
                        "plain_over_chorus_maxit": ("plain", "chorus-maxit"),
                        "chorus_maxit_over_fused": ("chorus-maxit", "fused")}.items():
        a = plain if a == "plain" and plains else a
        if a in median and b in median:
            row[key] = median[a] / median[b]
            if per_me.get(a) and per_me.get(b):
                row[key + "_per_member_epoch"] = per_me[a] / per_me[b]
    if plains and "chorus" in row["best"]:
        row["best_plain_minus_chorus"] = row["best"][plain] - row["best"]["chorus"]
        if hit[plain] or hit["chorus"]:
            row["best_gap_caveat"] = "a side hit its time budget: its best is over the trials it finished"
    if "chorus" in median and "fused" in median:
        first = row["first_result_s"]
        total = median["chorus"] - median["fused"]
        split = {"total_s": total}
        if first.get("chorus") is not None and first.get("fused") is not None:
            # Start-up: how much later (b)'s first result came than (c)'s first epoch;
            # the rest is what (b) spent after that beyond (c): Tune's driver, reads.
            split["startup_s"] = first["chorus"] - first["fused"]
            split["rest_s"] = total - split["startup_s"]
        row["chorus_minus_fused"] = split
    return row


def print_table(rows: list[dict]) -> None:
    rows = [row for row in rows if "median_wall_s" in row]  # a row with no timed run yet has no figures
    if not rows:
        return
    ways = list(dict.fromkeys(w for row in rows for w in row["median_wall_s"]))
    columns = " ".join(f"{w + ' s':>12} {'best':>6}" for w in ways)
    head = f"{'workload':14} {'sched':>10} {'ep':>3} {'bucket':>6} " + columns
    print(head + f" {'(a)/(b)':>8} {'per m-ep':>8} {'(b)/(c)':>8} {'(a)/(b0)':>8} {'read ms floor/b':>16}")
    for row in rows:
        cells = " ".join(
            f"{row['median_wall_s'][w]:12.1f}{'+' if row['budget_hit'][w] else ' '}{row['best'][w]:6.3f}"
            if w in row["median_wall_s"] else f"{'-':>12} {'-':>6}" for w in ways)
        ratios = " ".join(f"{row[k]:7.2f}x" if k in row else f"{'-':>8}"
                          for k in ("plain_over_chorus", "plain_over_chorus_per_member_epoch", "chorus_over_fused",
                                    "plain_over_lockstep"))
        read = row.get("read_ms", {})
        reads = "/".join("-" if read.get(w) is None else f"{read[w]:.1f}" for w in ("floor", "chorus"))
        print(f"{row['workload']:14} {row['scheduler']:>10} {row['epochs']:3d} {row['bucket_size']:6d} "
              f"{cells} {ratios} {reads:>16}")
    if any(any(row["budget_hit"].values()) for row in rows):
        print("+: that way hit --way-budget-s; its time is a lower bound")


def markdown_table(rows: list[dict]) -> str:
    """The table docs/benchmarks.md takes: one line per row, medians, (a) at its best share."""
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} s"

    def x(v: float | None, bold_at: float | None = None) -> str:
        if v is None:
            return "-"
        text = f"{v:.2f}×"
        return f"**{text}**" if bold_at is not None and v >= bold_at else text

    lines = ["| sweep | trials | bucket | (a) plain | (b) chorus | (c) fused | (a)/(b) | s per member-epoch a / b "
             "| (a)/(b) per member-epoch | (b) mean live / rows | member-epochs a / b / c (b wasted) "
             "| first result a / b | ms per queued result floor / b | (b)/(c) "
             "| (b)-(c): start-up / rest "
             "| best a / b |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [row for row in rows if "median_wall_s" in row]
    names = {"fifo": "FIFO", "asha": "ChorusASHA (a: stock ASHA)", "stock-asha": "stock ASHA, both"}
    for row in rows:
        med, hit, me = row["median_wall_s"], row["budget_hit"], row["member_epochs"]
        plain = row.get("plain_way")

        def wall(w: str | None, med: dict = med, hit: dict = hit) -> str:
            return "-" if w not in med else s(med[w]) + ("+" if hit.get(w) else "")
        share = f" ({plain.split('@')[1]} card)" if plain and "@" in plain else ""
        split = row.get("chorus_minus_fused", {})
        parts = (f"{split['startup_s']:.1f} / {split['rest_s']:.1f} s" if "startup_s" in split else "-")
        best = (f"{row['best'][plain]:.3f} / {row['best']['chorus']:.3f}" if plain and "chorus" in row["best"] else "-")
        best += " (cut: see JSON)" if "best_gap_caveat" in row else ""
        counts = " / ".join("-" if me.get(w) is None else f"{me[w]:g}" for w in (plain, "chorus", "fused"))
        if row.get("wasted", {}).get("chorus") is not None:
            counts += f" ({row['wasted']['chorus']:g})"
        per_me = row.get("s_per_member_epoch", {})
        ms = " / ".join("-" if per_me.get(w) is None else f"{1000 * per_me[w]:.0f} ms" for w in (plain, "chorus"))
        live, rows_run = row.get("mean_live", {}).get("chorus"), row.get("mean_rows", {}).get("chorus")
        fill = "-" if live is None else f"{live:.1f} / {rows_run:.1f}"
        first = row.get("first_result_s", {})
        firsts = " / ".join("-" if first.get(w) is None else f"{first[w]:.1f} s" for w in (plain, "chorus"))
        read = row.get("read_ms", {})
        reads = " / ".join("-" if read.get(w) is None else f"{read[w]:.1f} ms" for w in ("floor", "chorus"))
        lines.append(
            f"| {names.get(row['scheduler'], row['scheduler'])}, {'max_t ' if row['scheduler'] != 'fifo' else ''}"
            f"{row['epochs']}{' epochs' if row['scheduler'] == 'fifo' else ''}, {row['workload']} | {row['trials']} "
            f"| {row['bucket_size']} "
            f"| {wall(plain)}{share} | {wall('chorus')} | {wall('fused')} | {x(row.get('plain_over_chorus'))} "
            f"| {ms} | {x(row.get('plain_over_chorus_per_member_epoch'))} | {fill} | {counts} | {firsts} | {reads} "
            f"| {x(row.get('chorus_over_fused'))} "
            f"| {parts} | {best} |")
    if any(any(row["budget_hit"].values()) for row in rows):
        lines.append("\n+: hit the time budget; that time is a lower bound and its trials did not all finish.")
    return "\n".join(lines) + "\n"


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def environment(device: str) -> dict:
    """What ran it: machine, card, driver, Python, torch (and its CUDA), Ray."""
    import ray

    cuda = device == "cuda" and torch.cuda.is_available()
    card = torch.cuda.get_device_name(0) if cuda else None
    return {"machine": f"{platform.machine()} {os.cpu_count()} CPUs" + (f", {card}" if card else ""),
            "device": device, "device_name": card, "driver": gpu_driver() if cuda else None,
            "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "ray": ray.__version__}


def write_json(path: str, summary: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=2)
    os.replace(tmp, path)


def parse_fractions(text: str | None) -> list[float] | None:
    if text is None:
        return None
    fractions = [float(f) for f in text.split(",") if f.strip()]
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError("--gpu-fraction takes fractions in (0, 1], comma-separated")
    return fractions


@dataclass
class Plan:
    """The invocation's rows, ways and runs (what ``main`` executes)."""

    rows: list[RowSpec]
    ways: list[str]
    runs: list[tuple[int, int, str]] = field(default_factory=list)


def plan_from(args, parser: argparse.ArgumentParser | None = None) -> Plan:
    """Rows, ways and the run order from the parsed arguments (Ray-free)."""
    def fail(message: str):
        if parser is not None:
            parser.error(message)
        raise ValueError(message)

    names = args.workload.split(",")
    unknown = sorted(set(names) - set(workloads.WORKLOADS))
    if unknown:
        fail(f"unknown workload(s) {unknown}; choose from {sorted(workloads.WORKLOADS)}")
    if (args.n_train or args.n_val) and set(names) - set(workloads.SIZED):
        fail(f"--n-train/--n-val size only {sorted(workloads.SIZED)}")
    try:
        args.gpu_fractions = parse_fractions(args.gpu_fraction)
        if args.rows:
            rows = parse_rows(args.rows, names)
        else:
            schedulers = args.scheduler.split(",")
            if set(schedulers) - set(SCHEDULERS):
                raise ValueError(f"--scheduler takes {', '.join(SCHEDULERS)} (comma-separated)")
            rows = matrix_rows(names, schedulers, [int(b) for b in args.bucket_size.split(",")], args.epochs,
                               args.asha_epochs)
    except ValueError as exc:
        fail(str(exc))
    ways = args.ways.split(",")
    if set(ways) - set(WAYS):
        fail(f"--ways takes {', '.join(WAYS)}; got {args.ways}")
    if args.max_iterations_column and "chorus-maxit" not in ways:
        ways.insert(ways.index("chorus") + 1 if "chorus" in ways else len(ways), "chorus-maxit")
    ways = expand_ways(ways, args.gpu_fractions)
    if args.repeats < 1 or args.warmup < 0:
        fail("--repeats must be at least 1 and --warmup at least 0")
    return Plan(rows, ways, schedule(rows, ways, args.repeats, args.warmup))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="synth-mlp64",
                        help=f"one or more, comma-separated, of: {', '.join(sorted(workloads.WORKLOADS))}")
    parser.add_argument("--n-train", type=int, default=None, help=f"train rows of {sorted(workloads.SIZED)} (50k)")
    parser.add_argument("--n-val", type=int, default=None, help="validation rows of the same (10k)")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--rows", default=None,
                        help="the rows, scheduler:epochs:bucket, comma-separated (e.g. fifo:10:16,asha:10:32); "
                             "replaces --scheduler/--epochs/--asha-epochs/--bucket-size")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--asha-epochs", type=int, default=None, help="max_t under asha (default: --epochs)")
    parser.add_argument("--bucket-size", default="16", help="one or more, comma-separated")
    parser.add_argument("--max-buckets", type=int, default=None,
                        help="(b): buckets at once (default: as many as the resources hold)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--scheduler", default="asha",
                        help="fifo, asha and/or stock-asha, comma-separated. asha: stock ASHA (grace 1) in (a), "
                             "ChorusASHA in (b); stock-asha: stock ASHA in both; cohort halving in (c)")
    parser.add_argument("--reduction-factor", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every way on every row")
    parser.add_argument("--warmup", type=int, default=1,
                        help="discarded runs of every way first, on each workload's first row (0: none)")
    parser.add_argument("--ways", default="plain,chorus,lockstep,fused",
                        help="plain (a), chorus (b), chorus-maxit (b with max_iterations), lockstep (b0: "
                             "run_ahead=0), fused (c), floor (a no-op trainable: Tune's own cost per result)")
    parser.add_argument("--max-iterations-column", action="store_true",
                        help="add the way chorus-maxit: (b) with ChorusSearch(max_iterations=epochs) on FIFO rows")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu-fraction", default=None,
                        help="(a): each trial's share of the card on CUDA (default 1/16), of the cores on a CPU "
                             "(default: one core each); several, comma-separated, run as ways plain@f")
    parser.add_argument("--way-budget-s", type=float, default=None,
                        help="Tune's time_budget_s for every fit (a fit that hits it is marked)")
    parser.add_argument("--settle-timeout-s", type=float, default=120.0,
                        help="longest wait, before each run, for the cluster to be free again")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="file stem for the JSON, Markdown and PNG "
                                                     "(default: from the arguments)")
    args = parser.parse_args()
    plan = plan_from(args, parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"),  # a Ray of its own, not one left running
             include_dashboard=False, configure_logging=False, log_to_driver=False)
    env = environment(args.device)
    machine = env["machine"]
    print(f"{args.trials} trials, {len(plan.rows)} row(s), ways {','.join(plan.ways)}, {args.repeats} repeat(s) "
          f"after {args.warmup} warm-up(s), device={args.device}, machine: {machine}, driver {env['driver']}, "
          f"python {env['python']}, torch {env['torch']}, ray {env['ray']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    names = list(dict.fromkeys(r.workload for r in plan.rows))
    stem = os.path.join(args.out, args.name or (
        f"vs_tune-{'+'.join(names)}-t{args.trials}-"
        + "+".join(f"{r.scheduler}{r.epochs}b{r.bucket_size}" for r in plan.rows if r.workload == names[0])))
    tasks = {name: make_task(name, args.batch_size, args.n_train, args.n_val) for name in names}
    sweeps = {name: make_sweep(name, args.trials) for name in names}
    outcomes: list[dict[str, list[Outcome]]] = [{w: [] for w in plan.ways} for _ in plan.rows]
    warmups: list[dict] = []
    rows: list[dict] = []
    for spec in plan.rows:
        rows.append({"workload": spec.workload, "bucket_size": spec.bucket_size, "max_buckets": args.max_buckets,
                     "trials": len(sweeps[spec.workload].configs), "epochs": spec.epochs,
                     "scheduler": spec.scheduler, "batch_size": args.batch_size, "n_train": args.n_train,
                     "n_val": args.n_val, "device": args.device, "machine": machine,
                     "plain_resources": {w: plain_resources(way_args(args, w)) for w in plan.ways
                                         if way_kind(w) == "plain"}})

    def save(complete: bool) -> None:
        write_json(stem + ".json", {**env, "args": vars(args), "ways": plan.ways, "complete": complete,
                                    "rows": rows, "warmups": warmups})

    for n, (repeat, i, way) in enumerate(plan.runs, 1):
        spec = plan.rows[i]
        waited, settled = settle(args.settle_timeout_s)
        outcome = run_way(way, spec, tasks[spec.workload], sweeps[spec.workload], args)
        outcome.settle_s, outcome.settled, outcome.repeat = waited, settled, repeat
        tag = "warm-up " if repeat == 0 else f"repeat {repeat}"
        rate = outcome.trials_per_min
        print(f"  [{n}/{len(plan.runs)}] {spec.label}: {tag} {way:12} {outcome.wall_s:7.1f} s  "
              f"{'-' if rate is None else format(rate, '.1f')} trials/min  best {METRIC}={outcome.best:.4f}  "
              f"reached max_t: {outcome.reached_max_t}  member-epochs {outcome.member_epochs}"
              + (f" (wasted {outcome.wasted})" if way_kind(way) in TUNE_WAYS_CHORUS else "")
              + (f"  first result {outcome.first_result_s:.1f} s" if outcome.first_result_s is not None else "")
              + (f"  {outcome.read_ms:.1f} ms per queued result" if outcome.read_ms is not None else "")
              + (f"  buckets {outcome.buckets} ({outcome.buckets_solo} solo), start-up "
                 + ("-" if outcome.bucket_start_s is None else f"{outcome.bucket_start_s:.2f} s")
                 if outcome.buckets is not None else "")
              + f"  settled in {waited:.1f} s" + ("" if settled else " (TIMED OUT: leftovers shared the run)")
              + ("  (hit the time budget)" if outcome.budget_hit else ""), flush=True)
        if repeat == 0:
            warmups.append(dict(asdict(outcome), row=spec.label))
        else:
            outcomes[i][way].append(outcome)
            summarise(rows[i], outcomes[i])
        save(complete=False)
    ray.shutdown()
    save(complete=True)
    print_table(rows)
    table = markdown_table(rows)
    with open(stem + ".md", "w") as fh:
        fh.write(table)
    print(table)
    drawn = plot([row for row in rows if "median_wall_s" in row], stem + ".png")
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if drawn else " (no matplotlib: no PNG)"))


if __name__ == "__main__":
    main()
