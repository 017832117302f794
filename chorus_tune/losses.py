"""Per-sample losses, written so that they vmap over members unchanged."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: such a target's loss is 0


def _cross_entropy_by_gather(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``cross_entropy`` as vmap runs it natively: the same values and
    gradients (bit for bit, except where ``_log_softmax_over_classes`` takes
    the faster kernel: there to float32 rounding; tests/test_losses.py), in
    float32 under autocast as torch's is. Why: vmap has no batching rule for ``nll_loss``, so under vmap
    ``F.cross_entropy`` runs torch's Python decomposition of it on every call,
    and that calls ``torch._check``, which imports sympy on first use: 0.47
    CPU-s in every bucket process, before its first fused step (measured on
    this project's 2-core machine). A whole fused step takes as long either way
    (``benchmarks/fused_step.py --loss-form``: 0.94-1.06 times, the machine's
    noise). Class probabilities and unbatched outputs go to torch's own."""
    if target.is_floating_point() or output.dim() < 2:
        return cross_entropy(output, target)
    if torch.is_autocast_enabled(output.device.type):
        output = output.float()  # autocast runs cross_entropy in float32
    picked = _log_softmax_over_classes(output).gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(target == IGNORE_INDEX, torch.zeros_like(picked), -picked)


# Torch's CPU log_softmax over a last dimension shorter than a vector register
# is slow: on this project's 2-core machine (torch 2.13, AVX-512), (1024, 10)
# logits took 198 us forward, against 11 us for the same values laid out
# class-first and reduced over dim 0 (another kernel). Under vmap, a fused
# step's loss with 16 members of 10 classes took 0.96 ms (forward and
# backward) against 0.79 ms laid out class-first; from 8 to 15 classes the
# class-first layout won, at 2-4 classes and from 16 on it did not
# (benchmarks/fused_step.py measures the whole step). The two kernels sum in
# another order, so the values agree to float32 rounding, not bit for bit.
_CLASS_FIRST_CLASSES = range(8, 16)


def _log_softmax_over_classes(output: torch.Tensor) -> torch.Tensor:
    """``log_softmax(output, dim=1)``, through the faster kernel where one is
    measured faster (see ``_CLASS_FIRST_CLASSES``): (N, C) logits on a CPU."""
    if output.dim() == 2 and output.device.type == "cpu" and output.shape[1] in _CLASS_FIRST_CLASSES:
        return torch.log_softmax(output.t().contiguous(), dim=0).t()
    return torch.log_softmax(output, dim=1)


# The form a vmapped call uses for a named loss whose torch form vmaps slowly.
# Only there: the eager route and chorus_tune.reference (plain Tune in the
# benchmarks) keep torch's fused kernel.
_VMAP_FORMS: dict[LossFn, LossFn] = {cross_entropy: _cross_entropy_by_gather}


def vmap_form(loss_fn: LossFn) -> LossFn:
    """The form of ``loss_fn`` for calls under ``torch.vmap``: the same values
    and gradients, without a per-call Python decomposition where torch has
    one (``cross_entropy``); any other loss as it is."""
    return _VMAP_FORMS.get(loss_fn, loss_fn)


def stacked_mean_loss(loss_fn: LossFn) -> LossFn | None:
    """Every member's mean loss at once, ``(K, N, ...)`` outputs and targets to
    ``(K,)``, for a named loss (per sample: a sample's loss reads its own row
    only, so the members' samples are one batch): the batched route's training
    objective (chorus_tune/batched.py), without vmap's cost per op. ``None``
    for a loss of the user's own, which may mix samples: it runs under vmap."""
    per_sample = vmap_form(loss_fn) if loss_fn in NAMED_LOSSES.values() else None
    if per_sample is None:
        return None

    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        members = output.shape[0]
        losses = per_sample(output.flatten(0, 1), target.flatten(0, 1))
        return losses.reshape(members, -1).mean(dim=1)
    fn.stacked = True  # MemberStack.batched_call: called on the stack as is, not under vmap
    return fn


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A (B,) target against a (B, 1) output would broadcast to (B, B) and train on
    # nonsense without an error: match the shapes first.
    if target.shape != output.shape and target.numel() == output.numel():
        target = target.reshape(output.shape)
    per_element = (output - target.to(output.dtype)) ** 2
    return per_element.reshape(per_element.shape[0], -1).mean(dim=1)


NAMED_LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve_loss(loss: Union[str, LossFn]) -> LossFn:
    if callable(loss):
        return loss
    try:
        return NAMED_LOSSES[loss]
    except KeyError:
        raise ValueError(f"loss must be one of {sorted(NAMED_LOSSES)} or a callable; got {loss!r}") from None


def label_smoothing_from_config(loss: Union[str, LossFn], config: dict) -> float:
    """The config's ``label_smoothing`` (0 when absent or ``None``), checked:
    a number in [0, 1), and only for ``loss="cross_entropy"``."""
    value = config.get("label_smoothing")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"label_smoothing must be a number in [0, 1); got {value!r}")
    if value and loss != "cross_entropy":
        raise ValueError(f"label_smoothing applies to loss='cross_entropy' only; this task's loss is {loss!r}")
    return float(value)


def smoothing_parts(loss_fn: LossFn) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A member's training objective in two parts, ``[ce, u]``, so that its
    label-smoothed loss is ``(1 - eps) * ce + eps * u`` for its own ``eps``.

    ``ce`` is the mean of ``loss_fn`` (plain cross entropy, exactly the
    unsmoothed objective) and ``u`` the mean over samples of
    ``-sum_c log_softmax(output)_c / C``. That is how
    ``F.cross_entropy(..., label_smoothing=eps)`` is built (torch:
    ``(1 - eps) * nll + eps / C * smooth``, per sample), and the mix is linear
    in ``eps``: so the fused call computes the parts once for every member and
    each member's own ``eps`` mixes them outside it (vmap takes no per-member
    float into ``F.cross_entropy``). Targets as class indices (``-100``, torch's
    ``ignore_index``, counts as zero, as torch's does) or as class probabilities.
    """
    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = loss_fn(output, target).mean()
        class_dim = 1 if output.dim() > 1 else 0
        smooth = -F.log_softmax(output, dim=class_dim).sum(class_dim)
        if not target.is_floating_point():
            smooth = smooth.masked_fill(target == IGNORE_INDEX, 0.0)
        return torch.stack([ce, (smooth.mean() / output.shape[class_dim]).to(ce.dtype)])
    return fn


def accuracy_count(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Correct predictions in a batch: the output's argmax over classes against
    the class index, or, for class-probability targets (floating, shaped like
    the output), against the argmax of each target. Compared as they were, a
    ``(B, C)`` target broadcast against the ``(B,)`` predictions: an error, or,
    where ``B == C``, a silently wrong count."""
    class_dim = 1 if output.dim() > 1 else 0
    if target.is_floating_point() and target.shape == output.shape:
        target = target.argmax(dim=class_dim)
    return (output.argmax(dim=class_dim) == target).sum()
