"""What a bucket's parts share (docs/design.md D5-D7): a member's record, the plan of an
iteration, a snapshot of the stack, the objectives of a fused call, and the errors a member
fails with (``chorus_tune.bucket`` exports those)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import losses
from .data import BatchOrder
from .optim import OptimizerSnapshot
from .rows import RowCopies
from .stack import mean_loss

STATE_FORMAT = 1
# The routes that run the whole stack in one call (MemberStack.call).
STACK_ROUTES = ("vmap", "compiled", "batched")


class MemberFailure(RuntimeError):
    """Members that failed in :meth:`Bucket.run_iteration` while the others
    completed it: raised once they have, with their metrics in ``results``
    (``{slot: metrics}``). ``slots`` are the failed members' slots, ``errors``
    ``{slot: message}`` says why each failed; the caller fails just those
    members (retires them) and keeps the rest. Both kinds below at once (rare)
    raise this base class with both kinds of errors.
    """

    def __init__(self, message: str, slots: tuple[int, ...], results: dict[int, dict[str, Any]],
                 errors: dict[int, str] | None = None):
        super().__init__(message)
        self.slots = tuple(slots)
        self.slot = self.slots[0]
        self.results = results
        self.errors = dict(errors) if errors is not None else {k: message for k in self.slots}

    def __reduce__(self):  # an actor's exception crosses processes pickled
        return type(self), (str(self), self.slots, self.results, self.errors)


class MemberMetricError(MemberFailure):
    """A task metric (``Task(metrics=...)``) raised, or returned no number, on
    the evaluation of the members in ``slots``; ``errors[slot]`` is the
    metric's own message, naming it and the member. Those members trained this
    iteration (their state has advanced); their results are not in
    ``results``: retire them."""


class MemberOutOfMemory(MemberFailure):
    """Members that ran out of memory in :meth:`Bucket.run_iteration` even
    trained one at a time.

    Raised only once the iteration's other members have completed: their
    metrics are in ``results`` (``{slot: metrics}``; with ``slots`` it covers
    every slot the iteration was asked for, each once). Each failed member is
    left in its slot exactly as it was when the iteration started (parameters,
    buffers, optimizer state, batch order, counters), so the caller fails just
    that member by retiring it, or moves it with ``member_state`` to a bucket
    with more room, and keeps the rest. ``slot`` is the first of ``slots``.
    """


@dataclass
class Snapshot:
    stack: RowCopies
    optimizer: OptimizerSnapshot


@dataclass
class IterationPlan:
    """One iteration's inputs, drawn once: every attempt at it (the fused one,
    then smaller groups after an out-of-memory error) trains each member on the
    same batches and learning rates it would have had."""

    live: list[int]
    steps: int
    lr: torch.Tensor  # (steps, capacity)
    index: torch.Tensor | None  # (steps, capacity, batch) rows of the tensor data, or None: shared batches
    orders: dict[int, dict]  # each member's batch order at the start, for members that end up not training
    # Shared-batch mode: the iteration's batches, kept (host memory, one
    # iteration's worth) so that a group retried after an error sees the same ones.
    tape: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (capacity,) label smoothing of each member, or None when no member of the plan smooths.
    smoothing: torch.Tensor | None = None
    # {slot: message}: members whose metric failed in a completed group (a group retried
    # after running out of memory adds its members' only once it completes).
    metric_errors: dict[int, str] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)  # members whose group completed

    def for_rows(self, rows: list[int]) -> "IterationPlan":
        """This plan for a stack gathered from ``rows`` (its row ``i`` is
        ``rows[i]``): the same batches and learning rates, renumbered."""
        return IterationPlan(list(range(len(rows))), self.steps, self.lr[:, rows],
                     None if self.index is None else self.index[:, rows], {}, self.tape,
                     None if self.smoothing is None else self.smoothing[rows])


@dataclass
class Member:
    config: dict
    seed: int
    family: str
    hp: dict[str, Any]
    iteration: int
    step: int
    order: BatchOrder | None
    label_smoothing: float = 0.0





def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@dataclass(frozen=True)
class Objectives:
    """What a fused call computes per member, built on one form of the loss:
    ``train`` (mean loss), ``smoothed`` (``losses.smoothing_parts``, only for
    members with label smoothing) and ``evaluate`` (sums on a batch)."""

    train: Callable
    smoothed: Callable
    evaluate: Callable

    @classmethod
    def of(cls, loss_fn: Callable, classification: bool) -> "Objectives":
        return cls(mean_loss(loss_fn), losses.smoothing_parts(loss_fn), eval_stats(loss_fn, classification))


def eval_stats(loss_fn: Callable, classification: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A member's evaluation sums on one batch: its summed loss (and, for
    classification, its count of correct predictions)."""
    def stats(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss_sum = loss_fn(output, target).float().sum()
        if not classification:
            return loss_sum.reshape(1)
        return torch.stack([loss_sum, losses.accuracy_count(output, target).to(loss_sum.dtype)])
    return stats
