"""One bucket per GPU against 2 and 4 buckets sharing one card (issue 10, section 4).

A sweep over several widths is several structures: each width gets buckets of
its own (docs/design.md D9). With the default of one GPU per bucket, one card
trains them one after another; with ``resources_per_bucket={"GPU": 0.5}`` two
buckets share the card, with 0.25 four. This runs the same chorus_tune sweep
(``ChorusTrainable`` + ``ChorusSearch(task=trainable)`` with their defaults,
FIFO with the run's stop dict and no ``max_iterations``, the Tune way;
``reuse_actors=True``) once per share, interleaved, and writes the wall time
of each side by side, as ratios to one bucket per card, with each share's
best final ``val_accuracy`` (the same members train in every setting, so
those should agree).

As in ``vs_tune.py``: before every timed run it waits until the cluster's
resources are all free and every bucket of the run before has closed (a
bucket holds its GPU until ``idle_close_s`` after its last read), and
records the wait (``settle_s``); each share gets ``--warmup`` discarded runs
first, and the order of the shares rotates from repeat to repeat.

On a machine without CUDA the card is a Ray custom resource ``card`` of 1
(each bucket asks for its share of it and for that share of the cores): the
code path is the same, the times say nothing about a GPU.

    python3 benchmarks/share_card.py --device cuda --workload cifar-cnn3 --widths 8,16,32 --lrs 16 --epochs 1
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_tune  # noqa: E402  (after the path tweak: benchmarks/ is not a package)

import workloads  # noqa: E402

METRIC, MODE = vs_tune.METRIC, vs_tune.MODE


def learning_rates(n: int) -> list[float]:
    return [round(0.003 * (100 ** (i / max(1, n - 1))), 6) for i in range(n)]  # 0.003 .. 0.3


def bucket_resources(share: float, device: str) -> dict:
    if device == "cuda":
        return {"GPU": share, "CPU": 1}
    return {"card": share, "CPU": round(min(1.0, share * (os.cpu_count() or 1)), 4)}


def run_share(share: float, args) -> dict:
    from ray import tune

    from chorus_tune import ChorusSearch, ChorusTrainable

    task = vs_tune.make_task(args.workload, args.batch_size, args.n_train, args.n_val)
    trainable = ChorusTrainable.for_task(task, resources_per_bucket=bucket_resources(share, args.device))
    search = ChorusSearch(task=trainable)  # the budget comes from the run's stop dict, as users write it
    space = {"width": tune.grid_search(args.widths), "lr": tune.grid_search(learning_rates(args.lrs)),
             "momentum": 0.9, "weight_decay": 0.0, "seed": 0}
    trials = len(args.widths) * args.lrs
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, search_alg=search, num_samples=trials,
                                        reuse_actors=True, time_budget_s=args.way_budget_s),
            run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": args.epochs}, verbose=0))
        results = tuner.fit()
    wall = time.perf_counter() - start
    best, reached = vs_tune.best_final(results, args.epochs)
    by_width = {}
    for r in results:
        if r.metrics and METRIC in r.metrics and not math.isnan(r.metrics[METRIC]):
            w = r.config["width"]
            by_width[w] = max(by_width.get(w, float("-inf")), r.metrics[METRIC])
    return {"gpu_per_bucket": share, "buckets_per_card": round(1 / share, 3), "wall_s": wall,
            "trials": len(results), "reached_max_t": reached, "best": best,
            "best_by_width": {str(k): v for k, v in sorted(by_width.items())},
            "budget_hit": args.way_budget_s is not None and wall >= args.way_budget_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="cifar-cnn3", choices=sorted(workloads.SIZED),
                        help="a workload whose model reads config['width']")
    parser.add_argument("--widths", default="8,16,32")
    parser.add_argument("--lrs", type=int, default=16, help="learning rates per width (0.003 .. 0.3)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--n-train", type=int, default=None)
    parser.add_argument("--n-val", type=int, default=None)
    parser.add_argument("--shares", default="1,0.5,0.25", help="GPU per bucket, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every share")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs of every share first (0: none)")
    parser.add_argument("--settle-timeout-s", type=float, default=120.0,
                        help="longest wait, before each run, for the cluster to be free again")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--way-budget-s", type=float, default=None, help="Tune's time_budget_s for every fit")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="share_card")
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    shares = [float(s) for s in args.shares.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"),  # a Ray of its own, not one left running
             include_dashboard=False, configure_logging=False, log_to_driver=False,
             **({} if args.device == "cuda" else {"resources": {"card": 1}}))
    env = vs_tune.environment(args.device)
    trials = len(args.widths) * args.lrs
    print(f"{trials} trials ({len(args.widths)} widths x {args.lrs} lrs), {args.epochs} epochs, "
          f"{args.workload}, device={args.device}, machine: {env['machine']}, driver {env['driver']}, "
          f"torch {env['torch']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.name + ".json")
    runs: list[dict] = []
    warmups: list[dict] = []

    def medians() -> dict[float, float]:
        walls = {share: [x["wall_s"] for x in runs if x["gpu_per_bucket"] == share] for share in shares}
        return {share: statistics.median(w) for share, w in walls.items() if w}

    def save(complete: bool) -> None:
        median = medians()
        base = median.get(shares[0])
        vs_tune.write_json(path, {**env, "args": vars(args), "trials": trials, "complete": complete,
                                  "median_wall_s": {str(k): v for k, v in median.items()},
                                  "first_over_share": {str(k): base / v for k, v in median.items()} if base else {},
                                  "runs": runs, "warmups": warmups})

    # Warm-ups first (discarded), then the repeats; the shares' order rotates each time.
    order = [(0, w) for w in range(args.warmup)] + [(r, r - 1) for r in range(1, args.repeats + 1)]
    for repeat, turn in order:
        for share in vs_tune.rotated(shares, turn):
            waited, settled = vs_tune.settle(args.settle_timeout_s)
            run = run_share(share, args)
            run.update(repeat=repeat, settle_s=waited, settled=settled)
            (warmups if repeat == 0 else runs).append(run)
            print(f"  {'warm-up ' if repeat == 0 else f'repeat {repeat}'} GPU/bucket {share:<5} "
                  f"({run['buckets_per_card']:g} per card) {run['wall_s']:7.1f} s  best {METRIC}={run['best']:.4f}  "
                  f"reached max_t: {run['reached_max_t']}  settled in {waited:.1f} s"
                  + ("" if settled else " (TIMED OUT: leftovers shared the run)")
                  + ("  (hit the time budget)" if run["budget_hit"] else ""), flush=True)
            save(complete=False)
    ray.shutdown()
    save(complete=True)
    median = medians()
    print(f"{'GPU per bucket':>14} {'buckets/card':>12} {'wall s':>8} {'(' + format(shares[0], 'g') + ')/(this)':>10}")
    for share, wall in median.items():
        ratio = f"{median[shares[0]] / wall:9.2f}x" if shares[0] in median else f"{'-':>10}"
        print(f"{share:14g} {1 / share:12g} {wall:8.1f} {ratio}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
