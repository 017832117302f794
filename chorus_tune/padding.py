"""The padding check: a member's padded forward and gradient against its own model's (docs/design.md D9).

chorus_tune/widths.py says which tensors may differ in width; what it cannot
see is whether the model's *forward* keeps a padded dimension apart: a
reshape that interleaves it (``x.transpose(1, 2).flatten(1)`` after a
channel-padded convolution), ``F.layer_norm`` over it, an output whose width
would change. So before a bucket takes a member into a padded stack (or widens
the stack under its members), it runs each affected member once at its own
widths and once embedded at the padded ones, on the probe batch, in train
mode with dropout deterministic (as the route probe runs it, D8), and compares
the outputs and every parameter's gradient (its own entries). A member that
disagrees is refused and the bucket says why: it needs a bucket of its own
widths.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call

from .configuration import deterministic_dropout
from .precision import autocast
from .route import same_math_mode
from .widths import Shape, corner, pad_into, widen

Tensors = dict[str, torch.Tensor]


def padding_disagreement(own: nn.Module, params: Tensors, buffers: Tensors, shapes: dict[str, Shape],
                         x: torch.Tensor, y: torch.Tensor, loss_fn, precision: str, device: torch.device,
                         tolerance: tuple[float, float]) -> str | None:
    """``None`` when the member (skeleton ``own`` with its ``params`` and
    ``buffers`` at its own shapes) computes the same output and gradients
    embedded in ``shapes`` as at its own widths; else why not, in words.

    Nothing given is changed (the tensors are copied). A member non-finite at
    its own widths is not judged: its divergence is its own.
    """
    rtol, atol = tolerance
    wide = widen(own, shapes)
    own = copy.deepcopy(own).to("meta")
    runs = []
    for module, padded in ((own, False), (wide, True)):
        p = {n: _copy(t, shapes[n] if padded else None).requires_grad_(t.requires_grad) for n, t in params.items()}
        b = {n: _copy(t, shapes[n] if padded else None) for n, t in buffers.items()}
        module.train()
        with same_math_mode(), deterministic_dropout(), autocast(precision, device):
            out = functional_call(module, (p, b), (x,))
            loss = loss_fn(out, y).mean()
        grads = torch.autograd.grad(loss, [t for t in p.values() if t.requires_grad], allow_unused=True)
        names = [n for n, t in p.items() if t.requires_grad]
        runs.append((out.detach().float(), dict(zip(names, grads))))
    (own_out, own_grads), (wide_out, wide_grads) = runs
    if not bool(torch.isfinite(own_out).all()):
        return None
    if own_out.shape != wide_out.shape:
        return (f"its output has shape {tuple(own_out.shape[1:])} per row at its own widths but "
                f"{tuple(wide_out.shape[1:])} padded: the model's output must not change width")
    if not torch.allclose(own_out, wide_out, rtol=rtol, atol=atol):
        return (f"its padded forward differs from its own model's by up to {_worst(own_out, wide_out):.3g}: "
                "the forward mixes a padded dimension (a reshape or flatten that interleaves it, a "
                "normalisation or attention over it)")
    for name, g in own_grads.items():
        w = wide_grads.get(name)
        if g is None and w is None:
            continue
        if g is None or w is None or not torch.allclose(w[corner(tuple(g.shape))].float(), g.float(),
                                                         rtol=rtol, atol=atol):
            return f"its padded gradient of {name!r} differs from its own model's"
    return None


def _copy(t: torch.Tensor, shape: Shape | None) -> torch.Tensor:
    t = t.detach()
    if shape is None or tuple(t.shape) == tuple(shape):
        return t.clone()
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    pad_into(out, t)
    return out


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / (b.abs() + 1e-12)).max())
