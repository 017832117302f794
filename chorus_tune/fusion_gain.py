"""Whether fusing pays on this device, measured: a few steps of K members fused
against the same steps of one member trained unfused (docs/design.md D2,
"Solo where fusing does not pay").

Why measure: on a CPU a fused step saves only the fixed costs of K steps
(Python, dispatch, the optimizer's passes), and what those are worth depends on
the model, the batch size and the machine. Measured on the 2-core machine, one
thread, K=16 against one member unfused: a width-64 MLP at batch 64 trained
4.6x faster per member fused, while the PyTorch tutorial's CNN gained at most
1.35x (at batch 4; less at 2 and 16) and the ConvNet of Ray's
``mnist_pytorch.py`` 1.2x. A gain that small does not pay for a bucket's
process, its reads and its waits under a scheduler that decides one trial at a
time: with every trial trained in its own process (solo) instead, the
tutorial's 64-trial sweep ran at 0.90x plain Tune against 0.49x fused, and the
mnist port at 1.04x against 0.69x (docs/benchmarks.md, Stop 64).

The probe trains copies: a task whose data is the first ``steps`` batches of
the training split and one batch of the validation split, so that an
iteration is ``steps`` steps and an evaluation costs next to nothing. It
changes nothing of the task it is given.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .task import Task, TensorSplit

__all__ = ["FusionGain", "measure_fusion_gain"]

# Warm-up iterations at most before the fused iteration is timed: the route
# probe times its candidates on training's first steps (docs/design.md D8).
_MAX_WARMUP = 4
# A step alone slower than this is bound by its arithmetic: fusing saves a step's
# fixed costs (Python, dispatch, the optimizer's passes: 0.4-0.9 ms a step for
# the MLPs and CNNs measured here), a few per cent of it at most. The probe then
# keeps to two members and one step, so that it stays a few of the model's
# steps long (8 members x 4 steps x 3 of a ResNet's 1 s steps would be 96 s).
COMPUTE_BOUND_STEP_S = 0.05
# A first iteration's step over this many times the limit is not timed again:
# no cold start costs that much, and a large model's steps are seconds each.
_CLEARLY_COMPUTE_BOUND = 10


@dataclass(frozen=True)
class FusionGain:
    """What one probe measured: ``members`` trained fused for ``steps`` steps
    took ``fused_s``; one of them unfused took ``own_s`` for the same steps;
    ``route``: the route the fused iteration ran."""

    members: int
    steps: int
    fused_s: float
    own_s: float
    route: str | None

    @property
    def ratio(self) -> float:
        """How many times faster a member trains fused than on its own (above 1: fusing pays)."""
        return self.members * self.own_s / self.fused_s if self.fused_s > 0 else float("inf")

    def describe(self) -> str:
        return (f"{self.members} members fused trained {self.ratio:.2f}x as fast per member as one alone "
                f"({self.fused_s * 1e3 / self.steps:.2f} ms a fused step on the {self.route} route, "
                f"{self.own_s * 1e3 / self.steps:.2f} ms a step alone)")


def measure_fusion_gain(task: Task, members: Sequence[tuple[dict, int]], steps: int = 4, repeats: int = 2,
                        device: str | torch.device = "cpu", threads: int = 1) -> FusionGain | None:
    """Train ``members`` (``(config, seed)`` pairs of one structure, two or
    more) fused for ``steps`` steps, and the first of them unfused for the
    same steps, each ``repeats`` times after a warm-up, on ``threads`` CPU
    threads of the calling thread; the best of each. ``None`` where it cannot
    be measured this way: a split that is not tensors (a ``Dataset``), a
    training split shorter than one batch, or an error in building or
    training them (the members' own trials meet it, and report it).

    The fused route is the one a bucket's probe would pick for such a model,
    without the probe's cost (it times every candidate on training's steps:
    0.3-0.7 s of the 2-core CPU for the tutorial's CNN, against 0.1-0.4 s for
    the whole measurement without it): the batched route where the model
    allows it (an MLP's fastest), else vmap, else whatever ``"auto"`` picks
    (eager, where vmap fails: no gain)."""
    from .unfused import UnfusedMember, warm_torch_optim

    if len(members) < 2:
        raise ValueError(f"a fusion gain needs two members or more; got {len(members)}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe = _probe_task(task, members[0][0], steps)
        if probe is None:
            return None
        warm_torch_optim()  # a process's first torch.optim step imports torch._dynamo: not the step's cost
        own = UnfusedMember(probe, members[0][0], members[0][1], device=device)
        if _step_s(own, probe.iteration_steps) > COMPUTE_BOUND_STEP_S:
            # A model whose step alone takes this long is bound by its arithmetic,
            # which fusing does not save: two members for one step show what is
            # left, in a few of its steps rather than K x steps x 3 of them.
            members, probe = members[:2], _probe_task(task, members[0][0], 1)
            own = UnfusedMember(probe, members[0][0], members[0][1], device=device)
            own.run_iteration()
        for route in _routes(probe, members, device):
            try:
                bucket = _warm_bucket(probe, members, device, route)
            except Exception:  # noqa: BLE001 - the next route (vmap may not run the model)
                continue
            # The member alone trains as many iterations as the bucket has members,
            # so both sides do the same work in about the same time: on a machine
            # whose cores are shared, a 40 ms fused iteration was preempted where a
            # 5 ms lone one was not (in the pool, at a run's start: the tutorial's
            # CNN at batch 2 measured 0.93x so, 1.5-1.7x on a quiet machine).
            # Interleaved, the best of each: a burst of load slows one pair.
            fused_s, own_s = float("inf"), float("inf")
            for _ in range(repeats):
                own_s = min(own_s, _timed(own.run_iteration, len(members)) / len(members))
                fused_s = min(fused_s, _timed(bucket.run_iteration))
            return FusionGain(len(members), probe.iteration_steps, fused_s, own_s, bucket.last_route)
        return None
    except Exception:  # noqa: BLE001 - the members' trials meet the error and report it
        return None
    finally:
        torch.set_num_threads(before)


def _routes(probe: Task, members: Sequence[tuple[dict, int]], device) -> list[str]:
    from .bucket import Bucket

    bucket = Bucket(probe, len(members), device=device, route="vmap")
    bucket.add(*members[0])
    return ["batched", "auto"] if bucket.stack.batched.eligible else ["vmap", "auto"]


def _warm_bucket(probe: Task, members: Sequence[tuple[dict, int]], device, route: str):
    """A bucket of ``members`` on ``route``, its first iterations run (and its route settled)."""
    from .bucket import Bucket

    bucket = Bucket(probe, len(members), device=device, route=route)
    for config, seed in members:
        bucket.add(config, seed)
    for _ in range(_MAX_WARMUP):
        bucket.run_iteration()
        if bucket.last_routes == 1:  # more: "auto"'s probe timed its candidates on this one
            break
    return bucket


def _probe_task(task: Task, config: dict, steps: int) -> Task | None:
    """``task`` with the first ``steps`` batches of its training split and one
    batch of its validation split as its data, an iteration being those steps."""
    train, val = task.load_data()
    if not isinstance(train, TensorSplit) or not isinstance(val, TensorSplit):
        return None
    batch = task.batch_size_for(config)
    steps = min(steps, len(train) // batch)
    if steps < 1:
        return None
    rows, val_rows = steps * batch, min(len(val), batch)
    return dataclasses.replace(task, data=(tuple(t[:rows] for t in train.tensors),
                                           tuple(t[:val_rows] for t in val.tensors)), iteration_steps=steps)


def _step_s(own, steps: int) -> float:
    """Seconds a step of ``own`` takes: its first iteration's, where that is
    far over the compute-bound limit, else its second's. Not the first's
    alone: the first pays allocations and first calls, and in the pool at a
    run's start it shares the cores with processes starting. Measured there
    (128 trials of a width-64 MLP, 2 cores): the first iteration's steps took
    over 50 ms against 0.66 ms after, the MLP was probed as compute-bound on
    two members (0.89x), and the whole run trained solo (0.95x plain Tune,
    against 1.34x in buckets, where 8 members measure 2.8x)."""
    first = _timed(own.run_iteration) / steps
    if first > _CLEARLY_COMPUTE_BOUND * COMPUTE_BOUND_STEP_S:
        return first
    return _timed(own.run_iteration) / steps


def _timed(run, times: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(times):
        run()
    return time.perf_counter() - start
