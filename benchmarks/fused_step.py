"""Throughput of a bucket's fused training step against K eager steps.

For K in 1, 4, 16, 64 and digits MLPs of hidden width 64, 128, 256 (batch 64)
plus a small CNN: the time of ``--steps`` training steps of a ``Bucket`` (its
stacked SGD with momentum, per-member learning rates, masking and route choice
all included) against the same steps taken by K separate models with
``torch.optim.SGD`` in one process, one after another. Both are timed
side by side in one run, interleaved, best of ``--repeats``; the ratio is
eager time / fused time (above 1: fused is faster). ``cnn3`` is the GPU
check's CIFAR-sized CNN (3 conv blocks + BatchNorm, 3x32x32, 2048 images).

``--variants`` times several fused variants side by side, each ``precision``
or ``precision:route`` (``fp32``, ``bf16``, ``fp32:compiled``, ``fp32:vmap``,
...; the route defaults to ``auto``, the bucket's probe). Every variant's
bucket is built and warmed (probe, compilation) once, then the repeats time
one iteration of each, and the eager loop in each precision, in turn. Each
fused time is set against the eager loop in its own precision, and against
the first variant (``bf16`` against ``fp32``: the bf16 speed-up).

The eager loop is uncompiled, so a ratio of a compiled variant (``fp32:compiled``)
mixes compilation with fusion: ``--compiled-eager`` also times the K eager models
each under ``torch.compile`` and reports every variant against that baseline too
(``ratio_vs_compiled_eager``; the JSON's ``baseline`` says what each ratio divides).

    .venv/bin/python benchmarks/fused_step.py [--device cuda] [--optimizer sgd|adam|adamw]
        [--models mlp64,mlp128,mlp256,cnn,cnn3] [--variants fp32,bf16,fp32:compiled] [--threads N] [--json out.json]

``--clip-cost`` measures instead what per-member gradient clipping
(``max_grad_norm``) costs a fused step: for each K, two buckets of the same
members, one with ``max_grad_norm=1.0`` for every member and one without,
timed interleaved, best of ``--repeats``; it prints ms per fused step with
clipping off and on, the difference, and the clipping alone (``clip op ms``:
``optim.clip_grad_norms`` on the bucket's own last gradients, best of 5 x 200
calls). Measured on the 2-core CPU (torch 2.13, ``--models mlp64 --threads 1
--repeats 10``, SGD with momentum, 40 steps), shared and loaded (load
average 17-29), two runs (``benchmarks/reported/clip_cost_cpu*.json``):

    run  K   off ms/step   on ms/step   difference   clip op ms
    1    16        8.46        11.12       +31%         0.29
    1    64       27.94        33.59       +20%         0.93
    2    16        9.21         7.25       -21%         0.17
    2    64       11.25        12.63       +12%         0.31

The clipping itself is about 2-3% of the unclipped step at both K. The
whole-step difference is the machine's noise here (four runs: -21% to +31%
at K=16, -22% to +20% at K=64), far larger than the clipping. A bucket where
no member clips skips it altogether.

    .venv/bin/python benchmarks/fused_step.py --clip-cost [--ks 16,64] [--models mlp64] [--threads 1]

``--loss-form`` measures what the vmap form of cross entropy
(``chorus_tune.losses.vmap_form``) gives a fused step: for each K, two buckets
of the same members on the vmap route, one whose vmapped calls take torch's
``F.cross_entropy`` (what a bucket ran before: under vmap, torch's Python
decomposition of ``nll_loss`` on every call) and one the vmap form (log-softmax
and a gather, the same values bit for bit), timed interleaved, best of
``--repeats``; ms per fused step (training and the iteration's evaluation).

    .venv/bin/python benchmarks/fused_step.py --loss-form [--ks 16,64] [--models mlp64] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Callable

import torch
from torch import nn

import chorus_tune as ct
from chorus_tune.examples_data import digits_split
from chorus_tune.precision import autocast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as bench_workloads  # noqa: E402  (after the path tweak: benchmarks/ is not a package)


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


def parse_variant(text: str) -> tuple[str, str]:
    precision, _, route = text.partition(":")
    return precision, route or "auto"


def fused_bucket(task: ct.Task, k: int, device: torch.device, variant: str) -> ct.Bucket:
    """A warmed bucket of ``k`` members for ``variant`` (its first iteration probes, compiles)."""
    precision, route = parse_variant(variant)
    task = ct.Task(task.model, task.data, optimizer=task.optimizer, batch_size=task.batch_size,
                   iteration_steps=task.iteration_steps, precision=precision, compile=route == "compiled")
    bucket = ct.Bucket(task, k, device=device, route=route)
    for c in configs(k, task.optimizer):
        bucket.add(c)
    bucket.run_iteration()  # route probe, compilation and warm-up
    sync(device)
    return bucket


def time_fused(bucket: ct.Bucket, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    bucket.run_iteration()
    sync(device)
    return time.perf_counter() - start


def eager_runner(task: ct.Task, k: int, device: torch.device, precision: str = "fp32", compiled: bool = False):
    """K models with torch.optim, trained one after another; returns a function that times one pass.
    ``compiled``: each model's forward (and so its backward) under ``torch.compile``, the
    fair baseline for the compiled route; compiled in the warm-up pass, not timed."""
    train, _ = task.load_data()
    x, y = (t.to(device) for t in train.tensors)
    steps = task.iteration_steps
    models, opts, orders = [], [], []
    for c in configs(k, task.optimizer):
        m = task.build_model(c, c["seed"]).to(device).train()
        models.append(torch.compile(m) if compiled else m)
        opts.append(torch_optimizer(task.optimizer, m.parameters(), c))
        orders.append(ct.data.BatchOrder(len(x), task.batch_size, c["seed"]))

    def run() -> None:
        for m, opt, order in zip(models, opts, orders):
            idx = order.take(steps).to(device)
            for s in range(steps):
                opt.zero_grad(set_to_none=True)
                with autocast(precision, device):
                    loss = nn.functional.cross_entropy(m(x[idx[s]]), y[idx[s]])
                loss.backward()
                opt.step()

    def timed() -> float:
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        return time.perf_counter() - start

    run()  # warm-up
    sync(device)
    return timed


def time_eager(task: ct.Task, k: int, device: torch.device, precision: str = "fp32") -> float:
    return eager_runner(task, k, device, precision)()


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    driver = None
    if cuda:
        try:
            from vs_tune import gpu_driver  # imports chorus_tune and torch only at module level

            driver = gpu_driver()
        except Exception:  # noqa: BLE001 - the driver's version is a nicety
            driver = None
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else None,
            "driver": driver, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ks", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                        help="the stacked optimizer timed (against its torch.optim counterpart)")
    parser.add_argument("--models", default="mlp64,mlp128,mlp256,cnn",
                        help="comma-separated subset of mlp64, mlp128, mlp256, cnn, cnn3")
    parser.add_argument("--variants", default="fp32",
                        help="fused variants, comma-separated: precision[:route], e.g. fp32,bf16,fp32:compiled")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (1 steadies timings on a shared machine)")
    parser.add_argument("--compiled-eager", action="store_true",
                        help="also time the K eager models under torch.compile, a baseline for the compiled route")
    parser.add_argument("--json", default=None, help="written after every row")
    parser.add_argument("--clip-cost", action="store_true",
                        help="time max_grad_norm clipping on against off instead (see the docstring)")
    parser.add_argument("--loss-form", action="store_true",
                        help="time torch's cross_entropy under vmap against its vmap form instead (see the docstring)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = args.variants.split(",")
    for v in variants:
        precision, route = parse_variant(v)
        if precision not in ("fp32", "bf16") or route not in ("auto", "vmap", "compiled", "eager"):
            parser.error(f"unknown variant {v!r}: precision fp32|bf16, route auto|vmap|compiled|eager")
    precisions = list(dict.fromkeys(parse_variant(v)[0] for v in variants))
    (x, y), (xv, yv) = digits_split()
    # A tiny validation split: this measures training steps, not evaluation.
    flat = ((x, y), (xv[:64], yv[:64]))
    images = ((x.reshape(-1, 1, 8, 8), y), (xv[:64].reshape(-1, 1, 8, 8), yv[:64]))
    workloads = {f"mlp{w}": (mlp_factory(w), flat) for w in (64, 128, 256)}
    workloads["cnn"] = (cnn_factory, images)
    workloads["cnn3"] = (bench_workloads.cifar_cnn3(), bench_workloads.cifar_gratings(2048, 64))
    wanted = args.models.split(",")
    unknown = set(wanted) - set(workloads)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {sorted(workloads)}")
    workloads = {name: workloads[name] for name in wanted}
    env = environment(device)
    if args.clip_cost:
        return clip_cost(workloads, args, device, env)
    if args.loss_form:
        return loss_form(workloads, args, device, env)
    rows = []
    # What each ratio divides: the K-model loop is uncompiled unless said otherwise.
    baseline = {"ratio": "K torch.nn models with torch.optim, one after another, uncompiled, over fused"}
    if args.compiled_eager:
        baseline["ratio_vs_compiled_eager"] = "the same K models, each under torch.compile, over fused"

    def save() -> None:
        if args.json:
            with open(args.json + ".tmp", "w") as fh:
                json.dump({**env, "steps": args.steps, "optimizer": args.optimizer, "variants": variants,
                           "repeats": args.repeats, "baseline": baseline, "rows": rows}, fh, indent=2)
            os.replace(args.json + ".tmp", args.json)

    print(f"device={device} ({env['device_name'] or env['cpu']}) driver={env['driver']} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} steps={args.steps} optimizer={args.optimizer} (best of {args.repeats}); "
          f"eager = K uncompiled models" + (" (and compiled: --compiled-eager)" if args.compiled_eager else ""))
    if len(variants) == 1:
        print(f"{'model':8} {'K':>3} {'fused s':>9} {'eager s':>9} {'ratio':>7}  route")
    else:
        print(f"{'model':8} {'K':>3} " + " ".join(f"{'eager ' + p:>11}" for p in precisions) + " "
              + " ".join(f"{v:>24}" for v in variants) + "   (fused s, eager/fused, route)")
    for name, (factory, data) in workloads.items():
        task = ct.Task(factory, data, optimizer=args.optimizer, batch_size=64, iteration_steps=args.steps)
        for k in (int(v) for v in args.ks.split(",")):
            buckets = {v: fused_bucket(task, k, device, v) for v in variants}
            eagers = {p: eager_runner(task, k, device, p) for p in precisions}
            eagers_c = ({p: eager_runner(task, k, device, p, compiled=True) for p in precisions}
                        if args.compiled_eager else {})
            fused = {v: float("inf") for v in variants}
            eager = {p: float("inf") for p in precisions}
            eager_c = {p: float("inf") for p in eagers_c}
            for _ in range(args.repeats):  # interleaved, so drifting machine load hits all alike
                for v in variants:
                    fused[v] = min(fused[v], time_fused(buckets[v], device))
                for p in precisions:
                    eager[p] = min(eager[p], eagers[p]())
                for p in eagers_c:
                    eager_c[p] = min(eager_c[p], eagers_c[p]())
            route = {v: buckets[v].route for v in variants}
            ratio = {v: eager[parse_variant(v)[0]] / fused[v] for v in variants}
            row = dict(model=name, k=k, fused_s=fused[variants[0]], eager_s=eager[precisions[0]],
                       ratio=ratio[variants[0]], route=route[variants[0]])
            if len(variants) > 1:
                row.update(variants={v: dict(fused_s=fused[v], ratio=ratio[v], route=route[v],
                                             first_over_this=fused[variants[0]] / fused[v]) for v in variants},
                           eager_by_precision=eager)
            if eager_c:
                row.update(eager_compiled_by_precision=eager_c,
                           ratio_vs_compiled_eager={v: eager_c[parse_variant(v)[0]] / fused[v] for v in variants})
            rows.append(row)
            save()
            del buckets, eagers, eagers_c
            if len(variants) == 1:
                print(f"{name:8} {k:>3} {fused[variants[0]]:>9.4f} {eager[precisions[0]]:>9.4f} "
                      f"{ratio[variants[0]]:>6.2f}x  {route[variants[0]]}", flush=True)
            else:
                print(f"{name:8} {k:>3} " + " ".join(f"{eager[p]:>11.4f}" for p in precisions) + " "
                      + " ".join(f"{fused[v]:>9.4f} {ratio[v]:>6.2f}x {route[v]:>7}" for v in variants), flush=True)
            if eager_c:
                print(f"{'':8} {'':>3} against compiled eager: "
                      + " ".join(f"{v} {r:.2f}x" for v, r in row["ratio_vs_compiled_eager"].items()), flush=True)


def clip_op_seconds(bucket: ct.Bucket, device: torch.device, calls: int = 200) -> float:
    """Seconds of the clipping alone, on the bucket's own last gradients: the
    part of the fused step that ``max_grad_norm`` adds (best of 5 loops)."""
    from chorus_tune.optim import clip_grad_norms

    grads = [p.grad.clone() for p in bucket.stack.params.values() if p.grad is not None]
    limit = bucket.optimizer.max_grad_norm
    clipped = torch.isfinite(limit)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            clip_grad_norms(grads, limit, clipped)
        sync(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def print_setting(args: argparse.Namespace, device: torch.device, env: dict) -> None:
    print(f"device={device} ({env['device_name'] or env['cpu']}) torch={torch.__version__} "
          f"threads={torch.get_num_threads()} steps={args.steps} optimizer={args.optimizer} (best of {args.repeats})")


def best_interleaved(buckets: dict, repeats: int, device: torch.device) -> dict:
    """Each bucket's best iteration time over ``repeats``, timed in turn
    (interleaved: drifting load hits every bucket alike)."""
    best = {key: float("inf") for key in buckets}
    for _ in range(repeats):
        for key, bucket in buckets.items():
            best[key] = min(best[key], time_fused(bucket, device))
    return best


def side_by_side(workloads: dict, args: argparse.Namespace, device: torch.device, env: dict, report: str,
                 builds: dict, row: Callable[[str, int, dict, dict], dict]) -> None:
    """For each workload and K: one bucket per entry of ``builds`` (``label ->
    build(task, k)``), warmed up, then timed interleaved (``best_interleaved``);
    ``row(model, k, ms_per_step by label, buckets by label)`` prints the row and
    returns it. Rows go to ``--json`` under ``report`` after every one."""
    rows = []
    for name, (factory, data) in workloads.items():
        task = ct.Task(factory, data, optimizer=args.optimizer, batch_size=64, iteration_steps=args.steps)
        for k in (int(v) for v in args.ks.split(",")):
            buckets = {}
            for label, build in builds.items():
                bucket = build(task, k)
                bucket.run_iteration()  # route probe and warm-up
                buckets[label] = bucket
            best = best_interleaved(buckets, args.repeats, device)
            rows.append(row(name, k, {label: 1000 * s / args.steps for label, s in best.items()}, buckets))
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({**env, "steps": args.steps, "optimizer": args.optimizer, "repeats": args.repeats,
                               report: rows}, fh, indent=2)


def clip_cost(workloads: dict, args: argparse.Namespace, device: torch.device, env: dict) -> None:
    """ms per fused step with per-member ``max_grad_norm`` clipping off and on, side by side."""
    print_setting(args, device, env)
    print(f"{'model':8} {'K':>3} {'off ms/step':>12} {'on ms/step':>11} {'cost':>7} {'clip op ms':>11}  route")

    def clipping(clip: float | None) -> Callable[[ct.Task, int], ct.Bucket]:
        def build(task: ct.Task, k: int) -> ct.Bucket:
            bucket = ct.Bucket(task, k, device=device)
            for c in configs(k, args.optimizer):
                bucket.add(dict(c, max_grad_norm=clip))
            return bucket
        return build

    def row(name: str, k: int, ms: dict, buckets: dict) -> dict:
        off, on = ms[None], ms[1.0]
        op = 1000 * clip_op_seconds(buckets[1.0], device)
        print(f"{name:8} {k:>3} {off:>12.3f} {on:>11.3f} {100 * (on / off - 1):>+6.1f}% {op:>11.4f}  "
              f"{buckets[1.0].route}", flush=True)
        return dict(model=name, k=k, off_ms_per_step=off, on_ms_per_step=on, cost=on / off - 1,
                    clip_op_ms=op, route=buckets[1.0].route)

    side_by_side(workloads, args, device, env, "clip_cost", {None: clipping(None), 1.0: clipping(1.0)}, row)


def loss_form(workloads: dict, args: argparse.Namespace, device: torch.device, env: dict) -> None:
    """ms per fused step on the vmap route, torch's cross entropy against its vmap form, side by side."""
    print_setting(args, device, env)
    print(f"{'model':8} {'K':>3} {'torch ms/step':>14} {'vmap form ms/step':>18} {'ratio':>6}")

    def form(torch_form: bool) -> Callable[[ct.Task, int], ct.Bucket]:
        def build(task: ct.Task, k: int) -> ct.Bucket:
            bucket = ct.Bucket(task, k, device=device, route="vmap")
            if torch_form:
                bucket._vmap_fns = bucket._eager_fns  # what a bucket ran before: F.cross_entropy under vmap
            for c in configs(k, args.optimizer):
                bucket.add(c)
            return bucket
        return build

    def row(name: str, k: int, ms: dict, buckets: dict) -> dict:
        before, after = ms["torch"], ms["vmap_form"]
        print(f"{name:8} {k:>3} {before:>14.3f} {after:>18.3f} {before / after:>6.2f}", flush=True)
        return dict(model=name, k=k, torch_ms_per_step=before, vmap_form_ms_per_step=after, ratio=before / after)

    side_by_side(workloads, args, device, env, "loss_form", {"torch": form(True), "vmap_form": form(False)}, row)

if __name__ == "__main__":
    main()
