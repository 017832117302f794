"""Which widths share a padded stack: a stated rule on what padding costs (docs/design.md D9).

Padding spends compute on zeros: a member of width 32 in a stack padded to 256
runs (and pays for) the 256-wide step. The rule: a member shares a padded
stack only while the padded model costs at most ``factor`` times its own, for
every member of the stack (the widest shapes are each tensor's largest over
the members, so a newcomer can raise every member's price). The cost is the
estimated multiply-adds per sample of the model's Linear, Conv and Embedding
layers (``widths.Cost``), or its parameter count where its forward could not
be profiled.

Why 4 on a CPU: a fused step there is compute-bound, so its time grows with
the padded cost; a member that costs 4x what it would alone, fused with
members that would otherwise each run alone (one process, one step each),
still comes out ahead, and neighbouring widths of a doubling sweep (32 and
64: 4x for a hidden-to-hidden layer, 2x for the others) share. On a GPU a
small model's step is bound by kernel launches, not arithmetic: until the
padded step's work (members x batch x padded multiply-adds) reaches
``launch_bound_macs``, padding costs nearly nothing and the factor is
``launch_bound_factor``. Both numbers are stated, not measured here: the
rule is one class, so a measured cost model can replace it.

Torch-free: it reads numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Verdict:
    """The rule's answer for one stack: ``shares`` and, if not, ``reason``;
    ``factors`` is each member's padded cost over its own, in the order given."""

    shares: bool
    factors: tuple[float, ...]
    limit: float
    reason: str = ""


@dataclass(frozen=True)
class WidthRule:
    """Members share a padded stack while ``padded / own <= limit`` for each.

    ``factor``: the limit on a CPU, and on a GPU for a large step.
    ``launch_bound_factor``: the limit on a GPU while the padded step's work
    (``members * batch * padded``) is at most ``launch_bound_macs``.
    """

    factor: float = 4.0
    launch_bound_factor: float = 16.0
    launch_bound_macs: float = 2.0 ** 27

    def __post_init__(self) -> None:
        for name in ("factor", "launch_bound_factor", "launch_bound_macs"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 1:
                raise ValueError(f"WidthRule.{name} must be a number >= 1; got {value!r}")

    def limit(self, device_type: str, members: int, batch: int, padded: float) -> float:
        """The largest padded/own factor allowed for a stack of ``members`` at
        ``batch`` whose padded model costs ``padded`` per sample."""
        if device_type == "cuda" and members * batch * padded <= self.launch_bound_macs:
            return max(self.factor, self.launch_bound_factor)
        return self.factor

    def judge(self, own: Sequence[float], padded: float, device_type: str, batch: int,
              capacity: int | None = None) -> Verdict:
        """Whether members of costs ``own`` share a stack padded to ``padded``.
        ``capacity``: the stack's slots (the step runs them all), default the
        members given."""
        if not own:
            return Verdict(True, (), self.factor)
        factors = tuple(padded / max(c, 1e-12) for c in own)
        limit = self.limit(device_type, capacity if capacity is not None else len(own), batch, padded)
        worst = max(range(len(own)), key=factors.__getitem__)
        if factors[worst] <= limit:
            return Verdict(True, factors, limit)
        return Verdict(False, factors, limit,
                       f"padded to the widest shapes, a member costing {own[worst]:.4g} would cost {padded:.4g} "
                       f"({factors[worst]:.3g}x its own; the limit on {device_type} is {limit:.3g}x)")


# The rule a bucket follows unless told otherwise.
DEFAULT_RULE = WidthRule()
