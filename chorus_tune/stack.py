"""K modules of one structure as stacked tensors, and the two routes through them.

``MemberStack`` holds every parameter and buffer of ``capacity`` members as one
``(capacity, ...)`` tensor each. The *vmap* route runs them all in one call
(``torch.func.functional_call`` under ``torch.vmap``); the *eager* route runs
each member's own module in a loop over views of the same storage. Both write
BatchNorm running statistics in place into the stacked buffers.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from torch import nn
from torch.func import functional_call

from .losses import LossFn

Tensors = dict[str, torch.Tensor]


def structural_key(task, config: dict) -> tuple:
    """Who may share a bucket (docs/design.md D9): same class, parameter and buffer
    names/shapes/dtypes, batch size, optimizer family, loss and data.

    The model is built on the ``meta`` device: no memory, no initialisation
    cost. Raises what the model factory raises.
    """
    try:
        with torch.device("meta"):
            module = task.model(config)
    except Exception:
        # Some factories cannot run on meta (they read data or call .item());
        # a real build gives the same shapes, or the factory's real error.
        module = task.build_model(config, seed=0)
    return module_key(task, config, module)


def module_key(task, config: dict, module: nn.Module) -> tuple:
    """The structural key of ``config``, read off a model already built from it."""
    cls = type(module)
    loss = task.loss if isinstance(task.loss, str) else f"{task.loss.__module__}.{task.loss.__qualname__}"
    data = "static" if not callable(task.data) else f"{task.data.__module__}.{getattr(task.data, '__qualname__', '')}"
    return (
        f"{cls.__module__}.{cls.__qualname__}",
        tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()),
        task.batch_size_for(config),
        task.optimizer_for(config),
        loss,
        data,
    )


def module_tensors(module: nn.Module) -> tuple[Tensors, Tensors]:
    return dict(module.named_parameters()), dict(module.named_buffers())


def _dropout_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]


class MemberStack:
    """Stacked parameters and buffers of up to ``capacity`` members, plus each
    member's module skeleton (on the ``meta`` device: no second copy of weights).
    """

    def __init__(self, template: nn.Module, capacity: int, device: torch.device):
        params, buffers = module_tensors(template)
        self.capacity, self.device = capacity, device
        self.params: Tensors = {
            n: torch.zeros((capacity, *p.shape), dtype=p.dtype, device=device, requires_grad=p.requires_grad)
            for n, p in params.items()
        }
        self.buffers: Tensors = {
            n: torch.zeros((capacity, *b.shape), dtype=b.dtype, device=device) for n, b in buffers.items()
        }
        self.skeletons: list[nn.Module | None] = [None] * capacity

    # ----- members in and out -------------------------------------------------------------------
    def put(self, slot: int, module: nn.Module) -> None:
        params, buffers = module_tensors(module)
        with torch.no_grad():
            for n, p in params.items():
                self.params[n][slot].copy_(p)
            for n, b in buffers.items():
                self.buffers[n][slot].copy_(b)
        self.skeletons[slot] = copy.deepcopy(module).to("meta")

    def load_into(self, slot: int, module: nn.Module) -> nn.Module:
        """Copy ``slot``'s tensors into ``module`` (same structure), return it."""
        params, buffers = module_tensors(module)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.params[n][slot])
            for n, b in buffers.items():
                b.copy_(self.buffers[n][slot])
        return module

    def clear(self, slot: int) -> None:
        self.skeletons[slot] = None

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (compaction), renumbered from 0."""
        index = torch.tensor(rows, device=self.device)
        with torch.no_grad():
            self.params = {
                n: p[index].detach().clone().requires_grad_(p.requires_grad) for n, p in self.params.items()
            }
            self.buffers = {n: b[index].clone() for n, b in self.buffers.items()}
        self.skeletons = [self.skeletons[r] for r in rows]
        self.capacity = len(rows)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.buffers.values()]

    # ----- modes --------------------------------------------------------------------------------
    def _live_skeletons(self) -> Iterable[nn.Module]:
        return (s for s in self.skeletons if s is not None)

    def set_training(self, training: bool) -> None:
        for skeleton in self._live_skeletons():
            skeleton.train(training)

    def disable_dropout(self) -> list[nn.Module]:
        """Switch dropout off (for the route probe, where random masks would always differ)."""
        switched = [m for s in self._live_skeletons() for m in _dropout_modules(s) if m.training]
        for m in switched:
            m.eval()
        return switched

    # ----- the two routes -----------------------------------------------------------------------
    def vmap_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool, template: int) -> torch.Tensor:
        """``fn(output, target)`` for every slot at once, through ``template``'s skeleton."""
        skeleton = self.skeletons[template]

        def member(params: Tensors, buffers: Tensors, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return fn(functional_call(skeleton, (params, buffers), (xb,)), yb)

        data_dim = None if shared else 0
        return torch.vmap(member, in_dims=(0, 0, data_dim, data_dim), randomness="different")(
            self.params, self.buffers, x, y
        )

    def eager_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool, slots: list[int]) -> torch.Tensor:
        """``fn(output, target)`` per slot, each through its own module; rows of
        slots not listed are zeros."""
        results = {}
        for k in slots:
            params = {n: p[k] for n, p in self.params.items()}
            buffers = {n: b[k] for n, b in self.buffers.items()}
            xb, yb = (x, y) if shared else (x[k], y[k])
            results[k] = fn(functional_call(self.skeletons[k], (params, buffers), (xb,)), yb)
        template = next(iter(results.values()))
        return torch.stack([results.get(k, torch.zeros_like(template)) for k in range(self.capacity)])


def mean_loss(loss_fn: LossFn) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A member's training objective: the mean of its per-sample losses."""
    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target).mean()
    return fn
