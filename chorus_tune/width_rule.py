"""Which widths share a padded stack: a stated rule (docs/design.md D9).

Padding spends compute on zeros: a member of width 32 in a stack padded to 256
runs (and pays for) the 256-wide step. The rule puts each member in a
**band**, a pure function of its own widths, and members share a padded
stack only within one band:

- every width (each feature size of a Linear, Conv, BatchNorm or Embedding
  layer, chorus_tune/widths.py) falls in a bracket ``(r^(b-1), r^b]``; the
  band is the tuple of brackets. Within a band no width pads by ``r`` times
  or more, so no tensor pads by ``r^2`` or more (a weight has at most two
  widths), and neither does the model's cost: for a doubling sweep of an MLP
  at ``r = 4``, 32 pads to 64 (4x its hidden-to-hidden layer, 2x the others);
- ``r`` is ``ratio`` (4) on a CPU, where a fused step is compute-bound and its
  time grows with the padded cost. On a GPU a small model's step is bound by
  kernel launches, not arithmetic, and padding costs nearly nothing: while a
  member's padded step (``batch x its parameters x r^2``, for ``r`` the
  ``launch_bound_ratio``) stays within ``launch_bound_work`` multiply-adds,
  ``r`` is ``launch_bound_ratio`` (16).

Why a band and not a judgment of each stack's members: the pool groups
trials by a key computed from each config alone (chorus_tune/tune/execution/
grouping.py), and every member the pool sends a bucket must be one the bucket
takes; a band is such a key. The numbers are stated, not measured here; the
rule is one class, so a measured cost model can replace it.

Torch-free: it reads numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Band = tuple[float, tuple[int, ...]]


def bracket(width: int, ratio: float) -> int:
    """The ``b`` with ``ratio^(b-1) < width <= ratio^b``, by multiplication:
    exact for an integer ratio, where ``ceil(log(w) / log(r))`` is not
    (it puts 8^7 in bracket 8, measured in Python's floats)."""
    b, top = 0, 1
    while top < width:
        top *= ratio
        b += 1
    return b


@dataclass(frozen=True)
class WidthRule:
    """Members share a padded stack when their :meth:`band` is equal."""

    ratio: float = 4
    launch_bound_ratio: float = 16
    launch_bound_work: float = 2 ** 24

    def __post_init__(self) -> None:
        for name in ("ratio", "launch_bound_ratio", "launch_bound_work"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 1:
                raise ValueError(f"WidthRule.{name} must be a number > 1; got {value!r}")

    def ratio_for(self, params: int, device_type: str, batch: int) -> float:
        """The bracket ratio for a member of ``params`` parameters at ``batch``."""
        r = self.launch_bound_ratio
        if device_type == "cuda" and batch * params * r * r <= self.launch_bound_work:
            return r
        return self.ratio

    def band(self, widths: Sequence[int], params: int, device_type: str, batch: int) -> Band:
        """The band of a member with these ``widths`` (its width dimensions'
        sizes, in its structure's order) and ``params`` parameters."""
        r = self.ratio_for(params, device_type, batch)
        return r, tuple(bracket(int(w), r) for w in widths)


def describe_band(band: Band) -> str:
    """A band in words: its ratio and each distinct bracket as ``(low, high]``."""
    r, brackets = band
    spans = sorted(set(brackets))
    return f"ratio {r:g}: " + ", ".join(_span(b, r) for b in spans)


def _span(b: int, r: float) -> str:
    return f"({r ** (b - 1):g}, {r ** b:g}]" if b else "(0, 1]"


def describe_band_difference(ours: Band, theirs: Band) -> str:
    """Why two bands differ, in words: their ratios, or the first width that
    falls in another bracket."""
    (r, a), (r2, b) = ours, theirs
    if r != r2:
        return f"bracket ratios {r:g} vs {r2:g} (the wider one is for a launch-bound step on a GPU)"
    for x, y in zip(a, b):
        if x != y:
            return f"a width in {_span(x, r)} vs one in {_span(y, r)} (brackets of ratio {r:g})"
    return f"{len(a)} widths vs {len(b)}"


# The rule a bucket follows unless told otherwise.
DEFAULT_RULE = WidthRule()
