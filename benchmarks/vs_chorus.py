"""Fused-step throughput of chorus_tune's core against chorus-torch 0.1.0.

chorus-torch (imported as ``chorus``) is the library this project's idea comes
from: ``chorus.Stack`` runs K models through ``torch.vmap`` over stacked
parameters and ``chorus.StackedAdam`` gives each member its own learning rate.
This script trains the same K digits MLPs (64 -> width -> 10, batch 64, Adam
with a different lr per member, weight decay 0) on the same data with both and
times them side by side in one process, interleaved (the side that goes first
alternates), best of ``--repeats``. The ratio is chorus-torch time / chorus_tune
time: above 1, chorus_tune is faster. Targets (docs/design.md, "Targets, and
where they stand"): >= 1.0x at K=16 and >= 1.5x at K=64.

Set-up (chorus-torch is never a dependency of chorus_tune)
--------------------------------------------------------
chorus-torch 0.1.0 declares Python >= 3.13 but imports on 3.11, and it only
needs torch, so it is installed with ``--no-deps --ignore-requires-python``
into a folder of its own, ``.bench-venv/site`` (git-ignored), that only this
script puts on ``sys.path``; the project's ``.venv`` is not touched::

    .venv/bin/python benchmarks/vs_chorus.py --install      # once: pip install from PyPI
    .venv/bin/python benchmarks/vs_chorus.py [--ks 1,4,16,64] [--width 128]
        [--steps 40] [--repeats 5] [--data per-member|shared] [--route auto|vmap|eager]
        [--threads N] [--json out.json] [--profile]

On a machine other jobs share, pass ``--threads 1``: with torch's default of
one thread per core, a busy 2-core machine stretched single iterations by 10x
or more (OpenMP threads waiting on each other), for both sides, and best-of-N
no longer filtered that out. ``--profile`` prints a ``torch.profiler`` table of
one iteration per side and K.

``--install`` runs ``python -m pip install --no-deps --ignore-requires-python
--target .bench-venv/site chorus-torch==0.1.0`` (``--wheel PATH`` installs a
downloaded wheel instead). A ``chorus`` already importable from the running
environment is used as it is.

What one timed unit is, on each side
------------------------------------
One *iteration* = ``--steps`` training steps of all K members, then one
evaluation of all K on a 64-row validation split (as in
``benchmarks/fused_step.py``: this measures training steps, not evaluation).

chorus_tune: ``Bucket.run_iteration()`` on a ``Bucket(task, K)`` holding K
  members, every slot live (so the optimizer's no-masking fast path applies).
  Included: per-member batch indices for the iteration (each member's own
  seeded ``BatchOrder``), the per-step lr table, the gather of each step's
  ``(K, B, 64)`` batch, ``vmap(functional_call)`` forward + per-member mean
  cross-entropy, the backward of their sum, the stacked Adam update (its own
  ``(K,)`` hyperparameter tensors and per-member step counts), the per-member
  train-loss sums, and the fused evaluation (per-member val loss and accuracy,
  read back with ``.tolist()``). Excluded: the bucket's construction, ``add``,
  and the route probe (it runs in an untimed warm-up iteration). The route is
  whatever the bucket picks (``auto``: it times both routes on a probe batch,
  so on a busy machine it can pick the slower one) unless ``--route`` fixes
  it; it is printed per row.

chorus-torch: the loop its own runtime runs for a bucket (``step_bucket`` /
  ``run_lockstep``): ``opt.zero_grad(set_to_none=True)``;
  ``chorus.stacked_cross_entropy(stack.forward_split(xs), ys)`` (fused loss,
  the sum over members of each member's mean); ``.backward()``;
  ``opt.step()``. The optimizer is what ``chorus.optim.build_optimizer`` picks
  for members with different lrs: ``StackedAdam(stack, lr=[...],
  weight_decay=0, decoupled=False)`` for K > 1 (one stock ``torch.optim.Adam``
  param_group per member, over views of the stacked tensors; on a CPU, where
  its ``fused`` flag is off, torch runs its single-tensor Adam), and the stack
  is in ``vectorized`` mode, checked with an ``example_input``. K = 1 is
  chorus-torch's eager mode (``Stack`` never vectorises one model) with a plain
  ``torch.optim.Adam``. Its batches come from the same per-member
  ``BatchOrder`` indices as chorus_tune's (generated inside the timed unit, as
  on our side), which is cheaper than the K ``DataLoader``s its own runtime
  would iterate: this favours chorus-torch. Its evaluation is the equivalent
  fused pass written on the stack (``stack.eval()``, ``stack(x_val)`` under
  ``no_grad``, per-member loss and accuracy, ``.tolist()``). Per-step it keeps
  only the summed loss, not per-member train losses.

``--data shared`` compares the other data mode instead: the training split is
a plain ``Dataset`` on our side (one ``DataLoader`` per bucket, every member
sees the same batch) and chorus-torch iterates an identically built and seeded
``DataLoader`` and calls ``stack(x)`` (its ``run_lockstep`` shape, the one an
HPO sweep over a single dataset takes). Both pay the same collate cost.

Same work, checked: before timing, after one untimed iteration from identical
initial weights (``torch.manual_seed(seed); model(config)``) on identical
batches, the script compares every member's parameters between the two sides
and prints the largest difference (``max|dp|``); a difference above 1e-3 is
flagged.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import chorus_tune as ct
from chorus_tune.data import BatchOrder, SharedBatches
from chorus_tune.examples_data import digits_split

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = ROOT / ".bench-venv" / "site"
CHORUS_TORCH = "chorus-torch==0.1.0"
TARGETS = {16: 1.0, 64: 1.5}


# ----- getting chorus-torch --------------------------------------------------------------------------
def install_chorus(target: Path, wheel: str | None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--ignore-requires-python",
           "--upgrade", "--target", str(target), wheel or CHORUS_TORCH]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def import_chorus(target: Path):
    """``chorus`` from the running environment, else from ``target``."""
    try:
        return importlib.import_module("chorus")
    except ImportError:
        pass
    if target.is_dir():
        sys.path.insert(0, str(target))
        try:
            return importlib.import_module("chorus")
        except ImportError:
            sys.path.remove(str(target))
    sys.exit(f"chorus-torch is not installed. Run once:\n    {sys.executable} {' '.join(sys.argv[:1])} --install\n"
             f"(pip install --no-deps --ignore-requires-python --target {target} {CHORUS_TORCH})")


# ----- the workload --------------------------------------------------------------------------------
def mlp_factory(width: int):
    def build(config: dict) -> nn.Module:
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    return build


def configs(k: int) -> list[dict]:
    return [dict(lr=1e-3 * (1 + i % 8), seed=i) for i in range(k)]


class PlainDataset(Dataset):
    """Rows of (x, y) behind a plain ``Dataset``: chorus_tune's shared-batch mode."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Ours:
    def __init__(self, task: ct.Task, k: int, device: torch.device, route: str):
        self.bucket = ct.Bucket(task, k, device=device, route=route)
        for c in configs(k):
            self.bucket.add(c)

    def run(self) -> None:
        self.bucket.run_iteration()

    @property
    def route(self) -> str:
        return self.bucket.route

    def member_params(self, i: int) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.bucket.export_model(i).named_parameters()}


class Theirs:
    def __init__(self, chorus, task: ct.Task, k: int, steps: int, device: torch.device, shared: bool):
        self.chorus, self.k, self.steps, self.device, self.shared = chorus, k, steps, device, shared
        cfgs = configs(k)
        models = [task.build_model(c, c["seed"]).to(device) for c in cfgs]
        train, val = task.load_data()
        self.xv, self.yv = (t.to(device) for t in val.tensors)
        if shared:
            # chorus_tune's own shared stream: same seed, same batches as our bucket.
            self.batches = SharedBatches(train, task.batch_size, task.data_seed)
            probe = train.x[:2]
        else:
            self.x, self.y = (t.to(device) for t in train.tensors)
            self.orders = [BatchOrder(len(self.x), task.batch_size, c["seed"]) for c in cfgs]
            probe = self.x[:2]
        self.stack = chorus.Stack(models, example_input=probe).to(device)
        self.stack.train()
        lrs = [c["lr"] for c in cfgs]
        if self.stack.vectorized:
            self.opt = chorus.StackedAdam(self.stack, lr=lrs, betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=0.0, decoupled=False)
        else:  # K = 1: chorus-torch's eager mode, one ordinary param_group per member
            self.opt = torch.optim.Adam(
                [{"params": list(m.parameters()), "lr": lr} for m, lr in zip(self.stack.models, lrs)],
                lr=lrs[0])
        self.forward = self.stack.forward if shared else self.stack.forward_split

    @property
    def route(self) -> str:
        return f"{self.stack.mode}+{type(self.opt).__name__}"

    def run(self) -> None:
        chorus, stack, opt, device = self.chorus, self.stack, self.opt, self.device
        if not self.shared:
            index = torch.stack([o.take(self.steps) for o in self.orders], dim=1).to(device)  # (steps, K, B)
        stack.train()
        loss_sum = torch.zeros((), device=device)
        for s in range(self.steps):
            if self.shared:
                x, y = self.batches.next()
                inputs, target = x.to(device), y.to(device)
            else:
                idx = index[s]
                inputs, target = self.x[idx], self.y[idx]
            opt.zero_grad(set_to_none=True)
            total = chorus.stacked_cross_entropy(self.forward(inputs), target)
            total.backward()
            opt.step()
            loss_sum += total.detach()
        # The per-iteration evaluation our bucket does, as a fused pass on the stack.
        stack.eval()
        with torch.no_grad():
            out = stack(self.xv)  # (K, n_val, 10)
            k, n, c = out.shape
            val_loss = F.cross_entropy(out.reshape(k * n, c), self.yv.repeat(k), reduction="none")
            val_loss = val_loss.reshape(k, n).mean(dim=1)
            val_acc = (out.argmax(dim=-1) == self.yv).float().mean(dim=1)
            torch.stack([val_loss, val_acc]).tolist()
            loss_sum.item()
        stack.train()

    def member_params(self, i: int) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.stack.member_tensors(i).items()}


def max_param_diff(ours: Ours, theirs: Theirs, k: int) -> float:
    worst = 0.0
    for i in range(k):
        a, b = ours.member_params(i), theirs.member_params(i)
        for name, t in a.items():
            worst = max(worst, float((t.cpu() - b[name].cpu()).abs().max()))
    return worst


def source_revision() -> str:
    """The commit of the chorus_tune being measured, and whether its files differ from it."""
    package = Path(ct.__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no",
                                "--", "."],
                               capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    changed = [line[3:] for line in dirty.splitlines() if line.strip()]
    return f"git {rev}" + (f", uncommitted changes in {', '.join(changed)}" if changed else "")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def profile(side, device: torch.device, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        side.run()
    print(f"\n--- torch.profiler: {label}, one iteration ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ks", default="1,4,16,64")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="training steps per timed iteration")
    parser.add_argument("--repeats", type=int, default=5, help="timed iterations per side (best of)")
    parser.add_argument("--data", choices=("per-member", "shared"), default="per-member")
    parser.add_argument("--route", choices=("auto", "vmap", "eager"), default="auto",
                        help="our bucket's route (default: its own probe decides)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice); 1 is steadier on a busy machine")
    parser.add_argument("--json", default=None)
    parser.add_argument("--install", action="store_true", help=f"pip install {CHORUS_TORCH} first (see above)")
    parser.add_argument("--wheel", default=None, help="with --install: a local chorus-torch wheel instead of PyPI")
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="where --install puts chorus-torch")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per side and K")
    parser.add_argument("--profile-rows", type=int, default=15)
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = Path(args.target)
    if args.install:
        install_chorus(target, args.wheel)
    chorus = import_chorus(target)
    if getattr(chorus, "__version__", None) != "0.1.0":
        print(f"warning: measuring chorus {getattr(chorus, '__version__', '?')} from {chorus.__file__}, "
              "not chorus-torch 0.1.0", file=sys.stderr)
    device = torch.device(args.device)
    shared = args.data == "shared"

    (x, y), (xv, yv) = digits_split()
    train = PlainDataset(x, y) if shared else (x, y)
    # A tiny validation split: this measures training steps, not evaluation.
    task = ct.Task(mlp_factory(args.width), (train, (xv[:64], yv[:64])), optimizer="adam",
                   batch_size=args.batch_size, iteration_steps=args.steps)

    header = (f"device={device} torch={torch.__version__} chorus-torch={chorus.__version__} "
              f"threads={torch.get_num_threads()} cpus={os.cpu_count()} "
              f"cpu={platform.processor() or platform.machine()}\n"
              f"chorus_tune from {Path(ct.__file__).parent} ({source_revision()})\n"
              f"mlp width {args.width}, batch {args.batch_size}, adam (per-member lr), data={args.data}, "
              f"{args.steps} steps + eval per iteration, best of {args.repeats}, interleaved, "
              f"our route={args.route}")
    print(header)
    print(f"{'K':>3} {'ours s':>9} {'chorus s':>9} {'ratio':>7} {'target':>7} {'max|dp|':>9}"
          "  routes (ours | chorus-torch)")
    rows = []
    for k in (int(v) for v in args.ks.split(",")):
        ours = Ours(task, k, device, args.route)
        theirs = Theirs(chorus, task, k, args.steps, device, shared)
        ours.run()    # route probe + warm-up
        theirs.run()  # warm-up
        diff = max_param_diff(ours, theirs, k)
        best_ours = best_theirs = float("inf")
        for r in range(args.repeats):  # interleaved, alternating who goes first
            pair = [("ours", ours), ("theirs", theirs)]
            for name, side in (pair if r % 2 == 0 else pair[::-1]):
                t = timed(side.run, device)
                if name == "ours":
                    best_ours = min(best_ours, t)
                else:
                    best_theirs = min(best_theirs, t)
        ratio = best_theirs / best_ours
        goal = TARGETS.get(k)
        row = dict(k=k, ours_s=best_ours, chorus_torch_s=best_theirs, ratio=ratio, target=goal,
                   meets_target=None if goal is None else ratio >= goal,
                   ours_ms_per_step=1e3 * best_ours / args.steps,
                   chorus_torch_ms_per_step=1e3 * best_theirs / args.steps,
                   max_param_diff=diff, route_ours=ours.route, route_chorus_torch=theirs.route)
        rows.append(row)
        flag = "" if diff <= 1e-3 else "  DIFFERENT RESULTS"
        goal_s = "" if goal is None else f"{goal:.1f}x"
        print(f"{k:>3} {best_ours:>9.4f} {best_theirs:>9.4f} {ratio:>6.2f}x {goal_s:>7} {diff:>9.1e}  "
              f"{ours.route} | {theirs.route}{flag}", flush=True)
        if args.profile:
            profile(ours, device, f"chorus_tune K={k}", args.profile_rows)
            profile(theirs, device, f"chorus-torch K={k}", args.profile_rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "torch": torch.__version__, "chorus_torch": chorus.__version__,
                       "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "width": args.width,
                       "batch_size": args.batch_size, "steps": args.steps, "repeats": args.repeats,
                       "data": args.data, "route": args.route, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
