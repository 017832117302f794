"""What the bucket actor's parts share (docs/design.md D4, D12): its status line, how much
it keeps, the error for a member it does not hold, and small helpers on results and states."""
from __future__ import annotations

from typing import Any

import ray.cloudpickle as cloudpickle

# States of members that left, kept for a late save. Tune saves a trial's
# checkpoint before it lets the trial go, so few are ever read; each is a whole
# member state on the host.
RETIRED_KEEP = 16
MAX_QUEUE = 1024  # results one member may have waiting, whatever the memory allows
MISSING = object()

# One line per iteration in the bucket's log (the dashboard's Log link): the
# iteration (``chorus/bucket_iteration`` of its results), members in slots /
# slots when it ran, members it trained (``chorus/live``), the rows of the
# stack it computed (``chorus/rows``: the trained ones where the iteration
# gathered them, every slot where masked rows ran too), route, the CPU threads it
# ran on (rules/threads.py), seconds, the
# seconds per fused step, samples/s over all members, and wasted
# member-iterations so far (counted when a member leaves with unread results).
STATUS_LINE = ("%s: iteration %d, live %d/%d, trained %d, rows %d, route %s, threads %d, %.3f s, step %.2f ms, "
               "%.0f samples/s, wasted %d")


class MemberError(RuntimeError):
    """A call about a member this bucket does not hold."""


def member_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A core result without the fields the ``chorus/*`` keys report instead."""
    return {k: v for k, v in metrics.items() if k not in ("route", "seed")}


def portable(error: BaseException | None) -> BaseException | None:
    """``error`` as the pool can be sent it: itself, or, where it does not
    pickle (a factory's own exception may hold anything), a RuntimeError with
    its type and message. A notice that failed to pickle would raise here, in
    the bucket's iteration, instead of reaching the pool."""
    if error is None:
        return None
    try:
        cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the message still goes
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def state_bytes(state: dict) -> int:
    import torch

    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
