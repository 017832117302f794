"""Copies of member rows of stacked ``(capacity, ...)`` tensors, and putting them back.

``MemberStack`` and ``StackedOptimizer`` both keep one row per member; an
iteration's safety net (docs/design.md D13) and the route probe (D8) copy some
or all rows before a step and put them back after it. This is that copy, in
one place, so both classes snapshot the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowCopies:
    """Saved rows of a list of stacked tensors (``rows=None``: every row)."""

    rows: list[int] | None
    tensors: list[torch.Tensor]


def copy_rows(tensors: list[torch.Tensor], rows: list[int] | None = None, to_host: bool = False) -> RowCopies:
    """Copies of ``rows`` of each tensor (all rows if ``None``).

    ``to_host``: the copies go to host memory (asynchronously from CUDA: they
    are read only after the stream has passed them), so that a safety net does
    not itself take the device memory it guards.
    """
    index = None
    if rows is not None and tensors:
        index = torch.tensor(rows, device=tensors[0].device)
    copies = []
    for t in tensors:
        part = t.detach() if index is None else t.detach().index_select(0, index)
        if to_host:
            # index_select made a new tensor already; a whole tensor needs a real copy
            part = part.to("cpu", copy=index is None, non_blocking=True)
        elif index is None:
            part = part.clone()
        copies.append(part)
    return RowCopies(None if rows is None else list(rows), copies)


def put_rows(tensors: list[torch.Tensor], saved: RowCopies) -> None:
    """Write ``saved`` back into ``tensors`` (the same list, in the same order)."""
    if len(tensors) != len(saved.tensors):
        raise ValueError(f"{len(saved.tensors)} saved tensors for {len(tensors)} tensors: not their snapshot")
    with torch.no_grad():
        index = None
        for t, copy in zip(tensors, saved.tensors):
            if saved.rows is None:
                t.copy_(copy)
            else:
                if index is None:
                    index = torch.tensor(saved.rows, device=t.device)
                t.index_copy_(0, index, copy.to(t.device))
