"""One member trained unfused, as plain Tune trains a trial, whose state is a
bucket member's (docs/design.md D2 "Solo members", D7).

A member alone gains nothing from a stack, and a one-slot bucket's eager step
still pays for one: ``functional_call``'s tensor swaps, a row select per
parameter, and the stacked optimizer's per-member views. Measured on
synth-solo's two-hidden-layer MLP, one thread: 258 against 195 ms an epoch at
batch 32, 80 against 65 ms at batch 128 (1.25-1.3x the reference). So a member
that trains alone trains its own module with the stock ``torch.optim``
optimizer: the reference's training (``chorus_tune/reference.py``), which
every fused route is held to. What this module adds is the member state:
:class:`UnfusedMember` starts from, and gives back, the state a bucket's
``member_state`` writes, so a member moves between a bucket and this exactly.

The optimizer state's two forms (:func:`torch_optimizer_state`,
:func:`member_optimizer_state`): a bucket keeps every family's state tensors
for every member and a ``has_buffer`` flag (SGD's momentum buffer starts as a
copy of the first gradient); ``torch.optim`` keeps a parameter's state only
once it has stepped, SGD's buffer only where momentum is on, and Adam's step
count per parameter.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

import torch
from torch import nn

from .bucket_values import STATE_FORMAT
from .member_state import check_member_state, check_state_fits
from .optim import optimizer_family
from .reference import ReferenceRun

__all__ = ["UnfusedMember", "member_optimizer_state", "torch_optimizer_state", "torch_optim_ready",
           "warm_torch_optim"]

# The route a member trained here reports (``chorus/route``).
ROUTE = "unfused"

_warmed = False


def torch_optim_ready() -> bool:
    """Whether ``torch.optim``'s first use is already paid in this process
    (``torch._dynamo`` imported, by :func:`warm_torch_optim` or by anything
    else): until then a member trained here first pays about a second."""
    return _warmed or "torch._dynamo" in sys.modules


def warm_torch_optim() -> None:
    """Pay ``torch.optim``'s first use in this process now, once.

    Why: a process's first ``torch.optim`` optimizer imports ``torch._dynamo``
    (its methods are wrapped to disable dynamo, and that wrapper imports it on
    first call). A bucket's own stacked optimizer never does, so its first lone
    member paid it: measured on the 2-core machine, a lone iteration of
    synth-mlp2h took 0.68 s the first time against 0.05 s after (the import
    alone, 0.65 s), on the critical path of that member's trial. A bucket
    calls this while it waits for its trials, so that its first lone member
    does not wait for it.
    """
    global _warmed
    if _warmed:
        return
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.0)
    weight.grad = torch.zeros(1)
    optimizer.step()
    _warmed = True


class UnfusedMember:
    """One member of ``task`` trained unfused: :meth:`run_iteration` trains an
    iteration and returns its metrics (a bucket's keys), :meth:`member_state`
    is its state as ``Bucket.member_state`` writes it.

    ``state`` (a member state, from a bucket or from here) continues that
    member under ``config`` (``None``: the state's own config); its seed is
    the state's. ``device`` and ``splits`` are ``ReferenceRun``'s (a bucket
    training a lone member unfused hands its own copies of the data).
    """

    def __init__(self, task, config: dict | None, seed: int | None = None, state: Mapping | None = None,
                 device: str | torch.device = "cpu", splits: tuple | None = None):
        if state is not None:
            check_member_state(state)
            config = dict(state["config"] if config is None else config)
            seed = int(state["seed"])
        self.task, self.config = task, dict(config)
        self._run = ReferenceRun(task, self.config, seed, device, splits)
        self.family = self._run.family
        if state is not None:
            self._load(state)

    @property
    def iteration(self) -> int:
        return self._run.iteration

    @property
    def step(self) -> int:
        return self._run.step

    def load(self, state: Mapping) -> None:
        """Continue from ``state`` (this member's, saved anywhere since): its
        weights, optimizer state, place in the data and counters."""
        check_member_state(state)
        if int(state["seed"]) != self.seed:
            raise ValueError(f"a member state of seed {state['seed']} cannot load into the member of seed "
                             f"{self.seed}")
        self._load(state)

    @property
    def seed(self) -> int:
        return self._run.seed

    @property
    def model(self) -> nn.Module:
        return self._run.model

    def run_iteration(self) -> dict[str, Any]:
        metrics = self._run.run_iteration()
        metrics["route"] = ROUTE
        return metrics

    def member_state(self) -> dict[str, Any]:
        run = self._run
        return {
            "format": STATE_FORMAT,
            "config": dict(self.config),
            "seed": run.seed,
            "model": {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()},
            "optimizer": self.optimizer_state(),
            "iteration": run.iteration,
            "step": run.step,
            "data": None if run.order is None else run.order.state_dict(),
        }

    def optimizer_state(self) -> dict[str, Any]:
        """The member state's optimizer part (``StackedOptimizer.member_state``'s form)."""
        run = self._run
        return member_optimizer_state(self.family, run.optimizer, run.model, run.step)

    def _load(self, state: Mapping) -> None:
        # Checked before anything loads: a state of another structure or family
        # raises the bucket's own ValueError, naming what does not fit.
        run = self._run
        check_state_fits(state, self.family, run.model)
        run.model.load_state_dict(state["model"])
        momentum = float(run.hp.get("momentum", 0.0))
        run.optimizer.load_state_dict(torch_optimizer_state(self.family, run.optimizer, run.model,
                                                            state["optimizer"], momentum))
        if run.order is not None and state.get("data") is not None:
            run.order.load_state_dict(state["data"])
        run.iteration, run.step = int(state["iteration"]), int(state["step"])


def torch_optimizer_state(family: str, optimizer: torch.optim.Optimizer, model: nn.Module,
                          saved: Mapping[str, Any], momentum: float = 0.0) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the per-parameter state of a member
    state's ``saved`` optimizer state (``StackedOptimizer.member_state``) for
    ``model``'s parameters; ``momentum`` is the member's (SGD keeps a buffer only with it)."""
    spec = optimizer_family(family)  # an unknown family raises here, naming the known ones
    out = optimizer.state_dict()
    # A state_dict numbers the parameters in the order of its groups' params.
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    step = int(saved["step"])
    state: dict[int, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        tensors, i = saved["tensors"][name], index[id(p)]
        if spec.lazy_state:
            # SGD: torch keeps a buffer only with momentum on, and only once it has one.
            if momentum != 0 and saved.get("has_buffer", step > 0):
                state[i] = {n: tensors[n].clone() for n in spec.state_names}
        elif step > 0:  # torch.optim keeps no state before a parameter's first step
            state[i] = {n: tensors[n].clone() for n in spec.state_names}
            if spec.reads_steps:  # Adam's step count, per parameter in torch
                state[i]["step"] = torch.tensor(float(step))
    out["state"] = state
    return out


def member_optimizer_state(family: str, optimizer: torch.optim.Optimizer, model: nn.Module,
                           step: int) -> dict[str, Any]:
    """The member state's optimizer part (``StackedOptimizer.member_state``'s
    form) of ``optimizer`` over ``model``'s parameters after ``step`` steps."""
    spec = optimizer_family(family)
    tensors = {}
    for name, p in model.named_parameters():
        own = optimizer.state.get(p, {})
        tensors[name] = {}
        for state_name in spec.state_names:
            value = own.get(state_name)
            tensors[name][state_name] = (torch.zeros_like(p) if value is None else value).detach().to(
                "cpu", copy=True)
    return {"family": family, "step": int(step), "has_buffer": step > 0, "tensors": tensors}
