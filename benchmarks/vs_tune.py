"""The same sweep three ways: plain Ray Tune, chorus_tune, and the raw fused loop.

(a) plain   Ray Tune as a user runs it today: a function trainable training one
            model with ``chorus_tune.reference`` (stock ``torch.optim``),
            ``reuse_actors=True``, stock ``ASHAScheduler``, one CPU per trial
            (so every core runs a trial). On CUDA, as GPU users run it:
            ``tune.with_resources(train_fn, {"cpu": 1, "gpu": f})`` with
            ``--gpu-fraction f`` (1/8, 1/16), so 1/f trials share the card; on a
            CPU the same fraction of the machine's cores instead.
            The data: workloads made on the device (``workloads.SIZED``) are
            made once per trial process, where it trains, and kept across the
            trials that process serves; the others are built once by the
            driver and reach every trial through the object store
            (``tune.with_parameters``).
(b) chorus  ``ChorusTrainable`` + ``ChorusSearch`` + ``ChorusASHA``, same
            configs, seeds, epochs and ASHA settings.
(c) fused   the core's ``Bucket`` over the same members with no Ray at all,
            pruning each cohort at the same rungs as synchronous successive
            halving (what ChorusASHA decides for a full cohort), as many
            buckets at once as (b) runs (one process each, one core each on a
            CPU): the ceiling for (b).

All three run one after another in one invocation, repeated and interleaved
(a, b, c, a, b, c, ...), so a drifting machine load hits all alike. Printed and
written (JSON, PNG): median wall time, trials per minute, best final
``val_accuracy``, and the ratios (a)/(b) and (b)/(c). The JSON is rewritten
after every run, so a run cut short keeps what finished. ``--way-budget-s``
gives each ``Tuner.fit`` Tune's ``time_budget_s``: a way that hits it is
marked ``budget_hit`` (its time is then a lower bound).

    .venv/bin/python benchmarks/vs_tune.py --workload synth-mlp64 --trials 32 --epochs 10 --bucket-size 16
    .venv/bin/python benchmarks/vs_tune.py --workload synth-mlp64,synth-mlp256 --bucket-size 8,16,32  # a matrix
    python3 benchmarks/vs_tune.py --device cuda --workload cifar-cnn3 --trials 64 --epochs 2 \
        --scheduler fifo,asha --ways plain,chorus --gpu-fraction 0.125 --repeats 1   # on a GPU (gpu_check.sh)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chorus_tune as ct  # noqa: E402
from chorus_tune.reference import ReferenceRun  # noqa: E402

import workloads  # noqa: E402  (after the path tweak: benchmarks/ is not a package)

METRIC, MODE = "val_accuracy", "max"


@dataclass
class Outcome:
    way: str
    wall_s: float
    trials: int
    best: float
    reached_max_t: int
    budget_hit: bool = False

    @property
    def trials_per_min(self) -> float:
        return 60.0 * self.trials / self.wall_s


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


def best_final(results, max_t: int) -> tuple[float, int]:
    """Best final metric over the trials, and how many trials reached ``max_t``."""
    finals = [r.metrics for r in results if r.metrics and METRIC in r.metrics]
    best = max((m[METRIC] for m in finals if not math.isnan(m[METRIC])), default=float("nan"))
    return best, sum(1 for m in finals if m.get("training_iteration") == max_t)


def plain_resources(args) -> dict:
    """(a)'s request per trial: one CPU, or with ``--gpu-fraction f`` a fraction f of the
    card (and one CPU) on CUDA, f of the machine's cores on a CPU."""
    if args.gpu_fraction is None:
        return {"cpu": 1, "gpu": 1.0 / 16} if args.device == "cuda" else {"cpu": 1}
    if args.device == "cuda":
        return {"cpu": 1, "gpu": args.gpu_fraction}
    return {"cpu": round(max(0.01, args.gpu_fraction * (os.cpu_count() or 1)), 4)}


def run_plain(task: ct.Task, space: dict, args) -> Outcome:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

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
    scheduler = (ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=args.reduction_factor)
                 if args.scheduler == "asha" else None)
    tune_config = tune.TuneConfig(metric=METRIC, mode=MODE, reuse_actors=True, scheduler=scheduler,
                                  time_budget_s=args.way_budget_s)
    return fit_timed("plain", trainable, tune_config, space, args)


def fit_timed(way: str, trainable, tune_config, space: dict, args) -> Outcome:
    """Time one ``Tuner.fit`` of the sweep (both Tune ways share everything but trainable and config)."""
    from ray import tune

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable, param_space=tune_space(space), tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": args.epochs}, verbose=0),
        )
        results = tuner.fit()
    wall = time.perf_counter() - start
    best, reached = best_final(results, args.epochs)
    hit = args.way_budget_s is not None and wall >= args.way_budget_s
    return Outcome(way, wall, len(results), best, reached, hit)


def run_chorus(task: ct.Task, space: dict, args, lockstep: bool = False) -> Outcome:
    """(b) with its defaults: members train ahead of their trials (FIFO: to the
    budget the user gives ChorusSearch; ASHA: ChorusASHA's rungs). ``lockstep``:
    (b0), ``run_ahead=0`` with a trial process per slot, as chorus_tune ran
    before members trained ahead of their trials."""
    from ray import tune

    from chorus_tune import ChorusASHA, ChorusSearch, ChorusTrainable

    trainable = ChorusTrainable.for_task(task, bucket_size=args.bucket_size, max_buckets=args.max_buckets,
                                         run_ahead=0 if lockstep else 2)
    search = ChorusSearch(
        task=trainable,
        max_iterations=None if lockstep or args.scheduler == "asha" else args.epochs,
        max_concurrent_trials=args.bucket_size * fused_parallelism(args) if lockstep else None)
    tune_config = tune.TuneConfig(
        # With a Searcher, Tune's num_samples counts every trial (not passes over the grid).
        metric=METRIC, mode=MODE, search_alg=search, num_samples=args.trials,
        reuse_actors=True,  # as (a): a pruned trial's actor serves the next trial
        scheduler=(ChorusASHA(max_t=args.epochs, grace_period=1, reduction_factor=args.reduction_factor)
                   if args.scheduler == "asha" else None),
        time_budget_s=args.way_budget_s)
    return fit_timed("lockstep" if lockstep else "chorus", trainable, tune_config, space, args)


def run_lockstep(task: ct.Task, space: dict, args) -> Outcome:
    return run_chorus(task, space, args, lockstep=True)


def make_task(workload: str, batch_size: int, n_train: int | None = None, n_val: int | None = None) -> ct.Task:
    """The task of a named workload. Its data stays a callable: each bucket (and each
    (c) process) builds it once, so it never travels inside the trainable class to
    every trial actor. ``n_train``/``n_val`` size the workloads in ``workloads.SIZED``."""
    model, data = workloads.workload(workload, n_train, n_val)
    return ct.Task(model, data, optimizer="sgd", batch_size=batch_size)


def fused_block(workload: str, batch_size: int, device: str, configs: list[dict], epochs: int,
                rungs: set, reduction_factor: float, n_train: int | None = None,
                n_val: int | None = None) -> tuple[float, int]:
    """(c) for one bucket's worth of configs: the best final metric and how many reached the end."""
    if device == "cpu":
        torch.set_num_threads(1)  # as a bucket actor on a CPU-only cluster: one core each
    from chorus_tune.tune.halving import select_survivors

    bucket = ct.Bucket(make_task(workload, batch_size, n_train, n_val), len(configs), device=device)
    for config in configs:
        bucket.add(config)
    for epoch in range(1, epochs + 1):
        results = bucket.run_iteration()
        if epoch == epochs:
            finals = [m[METRIC] for m in results.values() if not math.isnan(m[METRIC])]
            return max(finals, default=float("nan")), len(results)
        if epoch in rungs:
            keep = set(select_survivors({str(s): m[METRIC] for s, m in results.items()}, reduction_factor))
            for slot in results:
                if str(slot) not in keep:
                    bucket.retire(slot)
            if 2 * len(bucket.live_slots) <= bucket.capacity:
                bucket.compact()
    return float("nan"), 0


def fused_parallelism(args) -> int:
    """How many buckets (b) trains at once by default: one per GPU, else one per core."""
    if args.max_buckets:
        return args.max_buckets
    if args.device == "cuda":
        return max(1, torch.cuda.device_count())
    return max(1, min(os.cpu_count() or 1, math.ceil(args.trials / args.bucket_size)))


def run_fused(task: ct.Task, space: dict, args) -> Outcome:
    from chorus_tune.tune.halving import rung_milestones

    rungs = set(rung_milestones(1, args.epochs, args.reduction_factor)) if args.scheduler == "asha" else set()
    configs = configs_of(space)
    blocks = [configs[i:i + args.bucket_size] for i in range(0, len(configs), args.bucket_size)]
    jobs = [(args.workload, args.batch_size, args.device, block, args.epochs, rungs, args.reduction_factor,
             args.n_train, args.n_val) for block in blocks]
    parallel = fused_parallelism(args)
    start = time.perf_counter()
    if parallel == 1:
        outcomes = [fused_block(*job) for job in jobs]
    else:
        # As many buckets at once as (b) runs, each in a process of its own (its
        # start-up counted, as (b)'s bucket actors' is); the next block goes to
        # the first process free, as (b) refills a freed bucket.
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(fused_block, *zip(*jobs)))
    wall = time.perf_counter() - start
    finals = [b for b, _ in outcomes if not math.isnan(b)]
    return Outcome("fused", wall, len(configs), max(finals, default=float("nan")), sum(n for _, n in outcomes))


def plot(rows: list[dict], path: str) -> bool:
    """One group of bars (each way's median wall time) per row; False where matplotlib
    is missing (the GPU machine's stock image has none: the JSON holds everything)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = [w for w in ("plain", "chorus", "lockstep", "fused") if w in rows[0]["median_wall_s"]]
    colors = {"plain": "#888", "chorus": "#2a7", "lockstep": "#a72", "fused": "#27a"}
    width = 0.8 / len(ways)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 3.8))
    for j, way in enumerate(ways):
        xs = [i + (j - (len(ways) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [row["median_wall_s"].get(way, 0.0) for row in rows], width, label=way, color=colors[way])
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


def summarise(row: dict, outcomes: dict[str, list[Outcome]]) -> dict:
    """The row's medians, bests and ratios from the runs so far."""
    done = {w: outs for w, outs in outcomes.items() if outs}
    median = {w: statistics.median(o.wall_s for o in outs) for w, outs in done.items()}
    row.update(
        median_wall_s=median,
        trials_per_min={w: 60.0 * row["trials"] / s for w, s in median.items()},
        best={w: max(o.best for o in outs) for w, outs in done.items()},
        budget_hit={w: any(o.budget_hit for o in outs) for w, outs in done.items()},
        runs={w: [asdict(o) for o in outs] for w, outs in done.items()},
    )
    for key, (a, b) in {"plain_over_chorus": ("plain", "chorus"), "chorus_over_fused": ("chorus", "fused"),
                        "plain_over_lockstep": ("plain", "lockstep")}.items():
        if a in median and b in median:
            row[key] = median[a] / median[b]
    if "plain" in row["best"] and "chorus" in row["best"]:
        row["best_plain_minus_chorus"] = row["best"]["plain"] - row["best"]["chorus"]
    return row


def measure(workload: str, bucket_size: int, scheduler: str, args, saved=lambda row: None) -> dict:
    """Every way on one workload, bucket size and scheduler, repeated and interleaved;
    the summary row. ``saved(row)`` is called with the row so far after every run."""
    epochs = args.asha_epochs if scheduler == "asha" and args.asha_epochs else args.epochs
    args = argparse.Namespace(**{**vars(args), "workload": workload, "bucket_size": bucket_size,
                                 "scheduler": scheduler, "epochs": epochs})
    task = make_task(workload, args.batch_size, args.n_train, args.n_val)
    space = sweep(args.trials)
    runners = {"plain": run_plain, "chorus": run_chorus, "lockstep": run_lockstep, "fused": run_fused}
    ways = args.ways.split(",")
    outcomes: dict[str, list[Outcome]] = {w: [] for w in ways}
    row = {"workload": workload, "bucket_size": bucket_size, "max_buckets": args.max_buckets,
           "trials": args.trials, "epochs": epochs, "scheduler": scheduler, "batch_size": args.batch_size,
           "n_train": args.n_train, "n_val": args.n_val,
           "plain_resources": plain_resources(args) if "plain" in ways else None}
    print(f"{workload}, bucket {bucket_size}, {scheduler} {epochs} epochs:", flush=True)
    for r in range(args.repeats):
        for way in ways:
            outcome = runners[way](task, space, args)
            outcomes[way].append(outcome)
            print(f"  repeat {r + 1} {way:7} {outcome.wall_s:7.1f} s  {outcome.trials_per_min:7.1f} trials/min  "
                  f"best {METRIC}={outcome.best:.4f}  reached max_t: {outcome.reached_max_t}"
                  + ("  (hit the time budget)" if outcome.budget_hit else ""), flush=True)
            saved(summarise(row, outcomes))
    return summarise(row, outcomes)


def print_table(rows: list[dict]) -> None:
    ways = list(rows[0]["median_wall_s"])
    columns = " ".join(f"{w + ' s':>9} {'best':>6}" for w in ways)
    head = f"{'workload':14} {'sched':>5} {'ep':>3} {'bucket':>6} " + columns
    print(head + f" {'(a)/(b)':>8} {'(b)/(c)':>8} {'(a)/(b0)':>8}")
    for row in rows:
        cells = " ".join(f"{row['median_wall_s'][w]:9.1f}{'+' if row['budget_hit'][w] else ' '}{row['best'][w]:6.3f}"
                         for w in ways)
        ratios = " ".join(f"{row[k]:7.2f}x" if k in row else f"{'-':>8}"
                          for k in ("plain_over_chorus", "chorus_over_fused", "plain_over_lockstep"))
        print(f"{row['workload']:14} {row['scheduler']:>5} {row['epochs']:3d} {row['bucket_size']:6d} {cells} {ratios}")
    if any(any(row["budget_hit"].values()) for row in rows):
        print("+: that way hit --way-budget-s; its time is a lower bound")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="synth-mlp64",
                        help=f"one or more, comma-separated, of: {', '.join(sorted(workloads.WORKLOADS))}")
    parser.add_argument("--n-train", type=int, default=None, help=f"train rows of {sorted(workloads.SIZED)} (50k)")
    parser.add_argument("--n-val", type=int, default=None, help="validation rows of the same (10k)")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--asha-epochs", type=int, default=None, help="max_t under asha (default: --epochs)")
    parser.add_argument("--bucket-size", default="16", help="one or more, comma-separated")
    parser.add_argument("--max-buckets", type=int, default=None,
                        help="(b): buckets at once (default: as many as the resources hold)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--scheduler", default="asha",
                        help="asha and/or fifo, comma-separated. asha: ASHA (grace 1) in (a), ChorusASHA in (b), "
                             "cohort halving in (c)")
    parser.add_argument("--reduction-factor", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ways", default="plain,chorus,lockstep,fused",
                        help="plain (a), chorus (b), lockstep (b0: run_ahead=0), fused (c)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu-fraction", type=float, default=None,
                        help="(a): each trial's share of the card on CUDA (default 1/16), of the cores on a CPU "
                             "(default: one core each)")
    parser.add_argument("--way-budget-s", type=float, default=None,
                        help="Tune's time_budget_s for every fit (a fit that hits it is marked)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="file stem for the JSON and PNG (default: from the arguments)")
    args = parser.parse_args()
    names = args.workload.split(",")
    unknown = sorted(set(names) - set(workloads.WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {sorted(workloads.WORKLOADS)}")
    if (args.n_train or args.n_val) and set(names) - set(workloads.SIZED):
        parser.error(f"--n-train/--n-val size only {sorted(workloads.SIZED)}")
    schedulers = args.scheduler.split(",")
    if set(schedulers) - {"asha", "fifo"}:
        parser.error("--scheduler takes asha, fifo or both (comma-separated)")
    if args.gpu_fraction is not None and not 0 < args.gpu_fraction <= 1:
        parser.error("--gpu-fraction must be in (0, 1]")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    sizes = [int(b) for b in args.bucket_size.split(",")]

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"),  # a Ray of its own, not one left running
             include_dashboard=False, configure_logging=False, log_to_driver=False)
    env = environment(args.device)
    machine = env["machine"]
    print(f"{args.trials} trials, {'+'.join(schedulers)} (rf={args.reduction_factor}), device={args.device}, "
          f"machine: {machine}, driver {env['driver']}, python {env['python']}, torch {env['torch']}, "
          f"ray {env['ray']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or (
        f"vs_tune-{'+'.join(names)}-t{args.trials}-e{args.epochs}-b{'+'.join(map(str, sizes))}-"
        f"{'+'.join(schedulers)}"))
    rows: list[dict] = []

    def save(partial: dict | None = None) -> None:
        done = rows + ([dict(partial, device=args.device, machine=machine)] if partial else [])
        complete = partial is None and len(rows) == len(schedulers) * len(names) * len(sizes)
        write_json(stem + ".json", {**env, "args": vars(args), "complete": complete, "rows": done})

    for scheduler in schedulers:
        for name in names:
            for size in sizes:
                row = measure(name, size, scheduler, args, saved=save)
                row.update(device=args.device, machine=machine)
                rows.append(row)
                save()
    ray.shutdown()
    print_table(rows)
    print(f"wrote {stem}.json" + (f" and {stem}.png" if plot(rows, stem + ".png") else " (no matplotlib: no PNG)"))


if __name__ == "__main__":
    main()
