"""Ray's own ``tune/examples/mnist_pytorch.py``, plain and ported to chorus_tune, side by side.

plain   Ray's example as it ships (Ray 2.x): its ``ConvNet``, ``train_func`` (batches
        until ``EPOCH_SIZE`` = 512 samples are passed: 9 of 64), ``test_func``
        (``TEST_SIZE`` = 256: 5 batches), ``SGD(lr, momentum)``, a stock
        ``AsyncHyperBandScheduler()`` (its defaults: ``max_t=100``, grace 1,
        reduction 4), the stop dict ``{"mean_accuracy": 0.98,
        "training_iteration": 100}``, ``num_samples=50`` of ``lr ~ loguniform(1e-4,
        1e-2)``, ``momentum ~ uniform(0.1, 0.9)``. Two changes, said here:
        - the data: MNIST is a download, and this project runs where there is
          none. ``mnist_shaped`` makes 28x28 one-channel images of 10 classes,
          each a smooth class pattern under noise, whose signal (0.4) was chosen
          so that the example's configs behave as on MNIST: the best reach 0.98
          in 6-25 iterations, lr 1e-3 and below not in 100 (measured with this
          ConvNet, 1 thread);
        - resources: the example asks 2 CPUs a trial, which on a 2-core machine
          runs one trial at a time. Plain Tune at its best here runs one trial
          per core (``{"cpu": 1}``, torch on 1 thread), as ``vs_tune.py``'s (a).
        The example leaves ``reuse_actors`` at Tune's default (False: a new
        process, and a new ``import torch``, for every trial); way
        ``plain-reuse`` sets ``reuse_actors=True``, as a user who knows Tune would.
chorus  The same sweep ported as the README teaches, and as issue 21's own
        metrics allow: ``ChorusTrainable.for_task(Task(...))`` with the same
        ``ConvNet``, ``F.nll_loss`` as the loss, 9 steps of 64 an iteration
        (``iteration_steps``), the 320 test images as the validation split and
        ``metrics={"mean_accuracy": ...}`` so that the scheduler and the stop dict
        read the example's metric; ``ChorusSearch(task=trainable)``; the
        example's scheduler, stop dict, space and ``num_samples`` unchanged
        (way ``chorus``), and with ``reuse_actors=True`` as the README's
        Quickstart sets it (way ``chorus-reuse``).

Both sides draw the same configs (Tune's default generator and ChorusSearch's
sampler, seeded alike). Runs are interleaved, the ways' order rotated from run
to run, after ``--warmup`` warm-ups of each, each after the cluster has settled
(``vs_tune.settle``). Printed and written (JSON, Markdown): wall time, member-
epochs (read, and for chorus the wasted beside them), seconds per member-epoch,
mean ``chorus/live`` and rows per fused iteration, time to the first result,
ms per queued result, best ``mean_accuracy``, and the trials the stop dict's
threshold ended.

``--step-costs`` measures instead, in this process (no Ray, one torch thread),
what one iteration (9 steps and the evaluation) costs per member: K ConvNets
trained one after another by ``chorus_tune.reference`` (plain Tune's
arithmetic) against a ``Bucket`` of K on the eager and vmap routes and on the
one its probe picks, for K = 1, 4, 16, interleaved, best of 7.

    make bench-mnist
    .venv/bin/python benchmarks/ray_mnist.py --repeats 2 --warmup 1 --out benchmarks/reported --name ray_mnist
    .venv/bin/python benchmarks/ray_mnist.py --step-costs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_tune  # noqa: E402  (settle, the results timeline, waste; benchmarks/ is not a package)

# ----- Ray's example, as it ships (data aside) ---------------------------------------------------
EPOCH_SIZE = 512
TEST_SIZE = 256
METRIC, MODE = "mean_accuracy", "max"
STOP = {"mean_accuracy": 0.98, "training_iteration": 100}
NUM_SAMPLES = 50
BATCH_SIZE = 64  # the example's get_data_loaders(batch_size=64)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def train_func(model, optimizer, train_loader):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        if batch_idx * len(data) > EPOCH_SIZE:
            return
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()


def test_func(model, data_loader):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch_idx, (data, target) in enumerate(data_loader):
            if batch_idx * len(data) > TEST_SIZE:
                break
            _, predicted = torch.max(model(data).data, 1)
            total += target.size(0)
            correct += (predicted == target).sum().item()
    return correct / total


def param_space() -> dict:
    from ray import tune

    return {"lr": tune.loguniform(1e-4, 1e-2), "momentum": tune.uniform(0.1, 0.9)}


def scheduler():
    from ray.tune.schedulers import AsyncHyperBandScheduler

    return AsyncHyperBandScheduler()


# ----- the data (MNIST's shape, made here) -----------------------------------------------------------
TRAIN_ROWS = 6_000  # the pool each iteration's 9 batches are drawn from
TEST_ROWS = 320  # what test_func reads: 5 batches of 64
TRAIN_STEPS = EPOCH_SIZE // BATCH_SIZE + 1  # train_func's batches: 0..8 pass `batch_idx * 64 > 512`


def mnist_shaped(signal: float = 0.4):
    """``((x, y), (x_test, y_test))``: 28x28 one-channel images of 10 classes, a smooth
    per-class pattern (seeded) times ``signal`` under unit noise."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    patterns = 3 * F.avg_pool2d(F.pad(patterns, (2, 2, 2, 2), mode="circular"), 5, stride=1)
    n = TRAIN_ROWS + TEST_ROWS
    y = torch.randint(0, 10, (n,), generator=g)
    x = signal * patterns[y] + torch.randn(n, 1, 28, 28, generator=g)
    return (x[:TRAIN_ROWS], y[:TRAIN_ROWS]), (x[TRAIN_ROWS:], y[TRAIN_ROWS:])


# ----- the two sides -------------------------------------------------------------------------------
def train_mnist(config: dict) -> None:
    """Ray's ``train_mnist``, its loaders over ``mnist_shaped`` (built in the trial, as the
    example builds its loaders there)."""
    from ray import tune

    torch.set_num_threads(1)
    (x, y), (xt, yt) = mnist_shaped()
    train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE,
                                               shuffle=True)
    test_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt, yt), batch_size=BATCH_SIZE,
                                              shuffle=True)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    while True:
        train_func(model, optimizer, train_loader)
        tune.report({"mean_accuracy": test_func(model, test_loader)})


def per_sample_nll(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(output, target, reduction="none")


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return (outputs.argmax(1) == targets).float().mean().item()


def ported_task():
    from chorus_tune import Task

    return Task(lambda config: ConvNet(), mnist_shaped, loss=per_sample_nll, optimizer="sgd",
                batch_size=BATCH_SIZE, iteration_steps=TRAIN_STEPS, metrics={"mean_accuracy": accuracy})


def ported_trainable(bucket_size: int):
    from chorus_tune import ChorusTrainable

    return ChorusTrainable.for_task(ported_task(), bucket_size=bucket_size)


def step_costs(ks=(1, 4, 16), repeats: int = 7) -> None:
    """Print ms per member-iteration: plain torch (``reference``) against a Bucket's routes."""
    from chorus_tune import Bucket
    from chorus_tune.reference import ReferenceRun

    torch.set_num_threads(1)
    task = ported_task()

    def config(i: int) -> dict:
        return {"lr": 0.001 * (1 + i), "momentum": 0.5, "seed": i}

    def plain(k: int):
        runs = [ReferenceRun(task, config(i)) for i in range(k)]
        for run in runs:
            run.run_iteration()  # warm-up
        return lambda: [run.run_iteration() for run in runs]

    def bucket(k: int, route: str):
        b = Bucket(task, k, route=route)
        for i in range(k):
            b.add(config(i))
        b.run_iteration()  # the probe (route "auto") and warm-up
        b.run_iteration()
        return b.run_iteration

    for k in ks:
        ways = {"plain": plain(k), "eager": bucket(k, "eager"), "vmap": bucket(k, "vmap"), "auto": bucket(k, "auto")}
        best = {way: float("inf") for way in ways}
        for _ in range(repeats):
            for way, one in ways.items():
                start = time.perf_counter()
                one()
                best[way] = min(best[way], time.perf_counter() - start)
        print(f"K={k:2}: " + ", ".join(f"{way} {1000 * t / k:.1f}" for way, t in best.items())
              + " ms per member-iteration", flush=True)


@dataclass
class Run:
    way: str
    wall_s: float
    read: int  # member-epochs whose results Tune read (the sum of training_iteration)
    wasted: int  # chorus: computed, never read
    best: float
    stopped_at_threshold: int  # trials the stop dict's mean_accuracy ended
    first_result_s: float | None
    mean_live: float | None
    mean_rows: float | None
    read_ms: float | None
    settle_s: float
    repeat: int

    @property
    def s_per_member_epoch(self) -> float:
        return self.wall_s / max(1, self.read + self.wasted)


WAYS = ("plain", "plain-reuse", "chorus", "chorus-reuse")


def fit(way: str, bucket_size: int) -> Run:
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    from chorus_tune import ChorusSearch
    from chorus_tune.tune.client import bucket_stats

    timeline = vs_tune.make_timeline()
    chorus = way.startswith("chorus")
    before = set(bucket_stats()) if chorus else set()
    if not chorus:
        trainable = tune.with_resources(train_mnist, {"cpu": 1})
        search = BasicVariantGenerator(random_state=0)
    else:
        trainable = ported_trainable(bucket_size)
        search = ChorusSearch(task=trainable, random_state=0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        results = tune.Tuner(
            trainable, param_space=param_space(),
            tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, scheduler=scheduler(), search_alg=search,
                                        num_samples=NUM_SAMPLES, reuse_actors=way.endswith("-reuse")),
            run_config=tune.RunConfig(name="exp", storage_path=storage, stop=STOP, verbose=0,
                                      callbacks=[timeline]),
        ).fit()
        wall = time.perf_counter() - start
        stats = {n: s for n, s in bucket_stats().items() if n not in before} if chorus else {}
    finals = [r.metrics for r in results if r.metrics and METRIC in r.metrics]
    live, rows = timeline.mean_live()
    return Run(way, wall, read=sum(int(m.get("training_iteration", 0)) for m in finals),
               wasted=vs_tune.wasted_total(timeline.wasted, stats),
               best=max(m[METRIC] for m in finals),
               stopped_at_threshold=sum(1 for m in finals if m[METRIC] >= STOP["mean_accuracy"]),
               first_result_s=None if timeline.first is None else timeline.first - start,
               mean_live=live, mean_rows=rows, read_ms=timeline.read_ms(), settle_s=0.0, repeat=0)


# Each way's summary: the median, over its timed runs, of each (``best``: of the best mean_accuracy).
_MEDIANS = {
    "median_wall_s": lambda r: r.wall_s,
    "median_member_epochs": lambda r: r.read + r.wasted,
    "median_wasted": lambda r: r.wasted,
    "median_s_per_member_epoch": lambda r: r.s_per_member_epoch,
    "median_first_result_s": lambda r: r.first_result_s,
    "median_mean_live": lambda r: r.mean_live,
    "median_mean_rows": lambda r: r.mean_rows,
    "median_read_ms": lambda r: r.read_ms,
    "best": lambda r: r.best,
}


def summary(runs: list[Run], ways: list[str]) -> dict:
    """Per way, the medians over its timed runs; and plain's over chorus's wall time,
    each as shipped and each with ``reuse_actors=True``, where both ran."""
    by = {w: [r for r in runs if r.way == w and r.repeat > 0] for w in ways}
    out: dict = {"ways": {}}
    for way, rs in by.items():
        out["ways"][way] = {"wall_s": [round(r.wall_s, 2) for r in rs],
                            **{key: vs_tune._median([value(r) for r in rs]) for key, value in _MEDIANS.items()}}
    walls = {w: v["median_wall_s"] for w, v in out["ways"].items()}
    for a, b in (("plain", "chorus"), ("plain-reuse", "chorus-reuse"), ("plain-reuse", "chorus")):
        if walls.get(a) and walls.get(b):
            out[f"{a} / {b}"] = walls[a] / walls[b]
    return out


def markdown(s: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| way | wall s (runs) | member-epochs (wasted) | s / member-epoch | first result s | mean live / rows "
             "| ms per queued result | best mean_accuracy |", "|---|---|---|---|---|---|---|---|"]
    for way, w in s["ways"].items():
        lines.append(f"| {way} | {f(w['median_wall_s'], '.1f')} ({', '.join(map(str, w['wall_s']))}) "
                     f"| {f(w['median_member_epochs'], '.0f')} ({f(w['median_wasted'], '.0f')}) "
                     f"| {f(w['median_s_per_member_epoch'], '.3f')} | {f(w['median_first_result_s'], '.1f')} "
                     f"| {f(w['median_mean_live'], '.1f')} / {f(w['median_mean_rows'], '.1f')} "
                     f"| {f(w['median_read_ms'], '.1f')} | {f(w['best'], '.4f')} |")
    ratios = [f"{k}: **{v:.2f}x**" for k, v in s.items() if " / " in k]
    if ratios:
        lines.append("\nMedian wall time, " + "; ".join(ratios))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-size", type=int, default=16)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of: {', '.join(WAYS)}")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="ray_mnist")
    parser.add_argument("--step-costs", action="store_true", help="only the in-process step costs (no Ray)")
    args = parser.parse_args()
    if args.step_costs:
        step_costs()
        return
    ways = args.ways.split(",")
    if not ways or any(w not in WAYS for w in ways):
        parser.error(f"--ways: comma-separated, of {', '.join(WAYS)}")

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    env = vs_tune.environment("cpu")
    print(f"Ray's mnist_pytorch.py, plain and ported: {args.repeats} repeat(s) after {args.warmup} warm-up(s), "
          f"machine: {env['machine']}, torch {env['torch']}, ray {env['ray']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    runs: list[Run] = []
    for repeat in range(args.warmup + args.repeats):
        timed = 0 if repeat < args.warmup else repeat - args.warmup + 1
        for way in vs_tune.rotated(ways, repeat):
            waited, _ = vs_tune.settle(120.0)
            run = fit(way, args.bucket_size)
            run.settle_s, run.repeat = waited, timed
            runs.append(run)
            print(f"  {'warm-up' if timed == 0 else f'repeat {timed}'} {way:12} {run.wall_s:6.1f} s  "
                  f"member-epochs {run.read + run.wasted} (wasted {run.wasted})  "
                  f"{run.s_per_member_epoch * 1000:.0f} ms each  first result "
                  f"{'-' if run.first_result_s is None else f'{run.first_result_s:.1f} s'}  mean live "
                  f"{'-' if run.mean_live is None else f'{run.mean_live:.1f}'}  best {run.best:.4f} "
                  f"({run.stopped_at_threshold} at the threshold)", flush=True)
            with open(stem + ".json", "w") as fh:
                json.dump({**env, "args": vars(args), "runs": [asdict(r) for r in runs],
                           "summary": summary(runs, ways) if timed else None}, fh, indent=1)
    ray.shutdown()
    table = markdown(summary(runs, ways))
    with open(stem + ".md", "w") as fh:
        fh.write(table)
    print(table)
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
