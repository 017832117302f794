"""Throughput of a bucket's fused training step against K eager steps.

For K in 1, 4, 16, 64 and digits MLPs of hidden width 64, 128, 256 (batch 64)
plus a small CNN: the time of ``--steps`` training steps of a ``Bucket`` (its
stacked SGD with momentum, per-member learning rates, masking and route choice
all included) against the same steps taken by K separate models with
``torch.optim.SGD`` in one process, one after another. Both are timed
side by side in one run, interleaved, best of ``--repeats``; the ratio is
eager time / fused time (above 1: fused is faster).

    .venv/bin/python benchmarks/fused_step.py [--device cuda] [--optimizer sgd|adam|adamw]
        [--models mlp64,mlp128,mlp256,cnn] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from torch import nn

import chorus_tune as ct
from chorus_tune.examples_data import digits_split


def mlp_factory(width: int):
    def build(config: dict) -> nn.Module:
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    return build


def cnn_factory(config: dict) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 10),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def configs(k: int, family: str = "sgd") -> list[dict]:
    if family == "sgd":
        return [dict(lr=0.01 * (1 + i % 8), momentum=0.9, seed=i) for i in range(k)]
    return [dict(lr=1e-3 * (1 + i % 8), seed=i) for i in range(k)]


def torch_optimizer(family: str, params, config: dict) -> torch.optim.Optimizer:
    if family == "sgd":
        return torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"])
    if family == "adam":
        return torch.optim.Adam(params, lr=config["lr"])
    return torch.optim.AdamW(params, lr=config["lr"])


def time_fused(task: ct.Task, k: int, device: torch.device) -> tuple[float, str]:
    bucket = ct.Bucket(task, k, device=device)
    for c in configs(k, task.optimizer):
        bucket.add(c)
    bucket.run_iteration()  # route probe and warm-up
    sync(device)
    start = time.perf_counter()
    bucket.run_iteration()
    sync(device)
    return time.perf_counter() - start, bucket.route


def time_eager(task: ct.Task, k: int, device: torch.device) -> float:
    train, _ = task.load_data()
    x, y = (t.to(device) for t in train.tensors)
    steps = task.iteration_steps
    models, opts, orders = [], [], []
    for c in configs(k, task.optimizer):
        m = task.build_model(c, c["seed"]).to(device).train()
        models.append(m)
        opts.append(torch_optimizer(task.optimizer, m.parameters(), c))
        orders.append(ct.data.BatchOrder(len(x), task.batch_size, c["seed"]))

    def run() -> None:
        for m, opt, order in zip(models, opts, orders):
            idx = order.take(steps).to(device)
            for s in range(steps):
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(m(x[idx[s]]), y[idx[s]]).backward()
                opt.step()

    run()  # warm-up
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ks", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                        help="the stacked optimizer timed (against its torch.optim counterpart)")
    parser.add_argument("--models", default="mlp64,mlp128,mlp256,cnn",
                        help="comma-separated subset of mlp64, mlp128, mlp256, cnn")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (1 steadies timings on a shared machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    (x, y), (xv, yv) = digits_split()
    # A tiny validation split: this measures training steps, not evaluation.
    flat = ((x, y), (xv[:64], yv[:64]))
    images = ((x.reshape(-1, 1, 8, 8), y), (xv[:64].reshape(-1, 1, 8, 8), yv[:64]))
    workloads = {f"mlp{w}": (mlp_factory(w), flat) for w in (64, 128, 256)}
    workloads["cnn"] = (cnn_factory, images)
    wanted = args.models.split(",")
    unknown = set(wanted) - set(workloads)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {sorted(workloads)}")
    workloads = {name: workloads[name] for name in wanted}
    rows = []
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"cpu={platform.processor() or platform.machine()} steps={args.steps} optimizer={args.optimizer} "
          f"(best of {args.repeats})")
    print(f"{'model':8} {'K':>3} {'fused s':>9} {'eager s':>9} {'ratio':>7}  route")
    for name, (factory, data) in workloads.items():
        task = ct.Task(factory, data, optimizer=args.optimizer, batch_size=64, iteration_steps=args.steps)
        for k in (int(v) for v in args.ks.split(",")):
            fused, eager, route = float("inf"), float("inf"), None
            for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
                f, route = time_fused(task, k, device)
                fused = min(fused, f)
                eager = min(eager, time_eager(task, k, device))
            row = dict(model=name, k=k, fused_s=fused, eager_s=eager, ratio=eager / fused, route=route)
            rows.append(row)
            print(f"{name:8} {k:>3} {fused:>9.4f} {eager:>9.4f} {eager / fused:>6.2f}x  {route}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "steps": args.steps, "optimizer": args.optimizer, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
