"""Which widths share a padded stack: a stated rule on what padding costs (docs/design.md D9).

Padding spends compute on zeros: a member of width 32 in a stack padded to 256
runs (and pays for) the 256-wide step. The rule: members share a padded stack
only while the padded model costs at most ``factor`` times each member's own
(the widest shapes are each tensor's largest over the members, so a
newcomer can raise every member's price).

- ``factor`` (4) where a member's padded step is bound by a step's fixed
  costs, not its arithmetic: a doubling sweep of an MLP pairs neighbours
  there (32 padded to 64 costs 2.6x its own: 4x its hidden-to-hidden layer,
  2x the others; padded to 128, 7.6x).
- On a CPU, a step is bound by its fixed costs (Python, dispatch, the
  optimizer's passes) only while a member's padded step (``batch x`` the
  padded cost) is at most ``cpu_overhead_work`` multiply-adds (2^20); past
  that, arithmetic bounds it, every padded unit costs its full price, and
  sharing saves only one stack's fixed cost, so the factor is
  ``cpu_compute_factor`` (1.25). Measured on the 2-core CPU, one thread,
  vmap, batch 64, the two-hidden-layer MLP of ``benchmarks/workloads.py``
  (250 steps and an evaluation an iteration), seconds an iteration:

  =================  ======  ===============  =======
  members            shared  split (a + b)    padded
  =================  ======  ===============  =======
  8 x 32 + 8 x 64    0.78    0.35 + 0.43      563k
  8 x 64 + 8 x 128   1.49    0.43 + 0.73      1.66M
  8 x 128 + 8 x 256  3.79    0.73 + 1.64      5.4M
  =================  ======  ===============  =======

  (padded: multiply-adds of a member's padded step). A member's iteration
  costs about the same at widths 32 and 64 (25-26 ms: fixed costs) and
  grows with its multiply-adds beyond (91-103 ms at 128, 205-255 at 256).
- On a GPU a small model's step is bound by kernel launches, and padding
  costs nearly nothing: while a member's padded step is at most
  ``launch_bound_work`` multiply-adds (2^24), the factor is
  ``launch_bound_factor`` (16); past that, ``factor`` (not yet measured on
  a card).

The cost is what the caller prices: multiply-adds per sample, from a forward
on ``meta`` with an input row of the data (``widths.Profile``: a bucket with
its own data, the pool and the driver through ``widths.PaddingPrices``), else
parameters. The rule is one class, so a cost model fitted to a bucket's own
step timings can replace it.

:class:`WidthGroups` applies the rule to members as they come (the pool's
grouping, and ``space_split``'s count): each new set of widths joins the
first group of its structure that it can join with every member of the group
still within the factor, else opens one. Every stack of a group's members is
then within the factor too (its widest shapes are at most the group's).

Torch-free: it reads numbers and shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, Sequence

Shape = tuple[int, ...]
Shapes = Mapping[str, Shape]


def widest(shapes: Iterable[Shapes]) -> dict[str, Shape]:
    """Each tensor's elementwise largest shape over members of one structure."""
    out: dict[str, Shape] = {}
    for member in shapes:
        for n, s in member.items():
            out[n] = tuple(max(a, b) for a, b in zip(out[n], s)) if n in out else tuple(s)
    return out


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

    The limit depends on what bounds a member's padded step (``batch x
    padded`` multiply-adds): on a GPU, ``launch_bound_factor`` while launches
    do (it never goes below ``factor``); on a CPU, ``factor`` while the
    step's fixed costs do and, past ``cpu_overhead_work``,
    ``cpu_compute_factor`` (never above ``factor``: ``factor`` is the most a
    member pays wherever arithmetic bounds its step). Any other device type
    (``mps``, ``xpu``: not measured) gets ``factor``."""

    factor: float = 4
    launch_bound_factor: float = 16
    launch_bound_work: float = 2 ** 24
    cpu_compute_factor: float = 1.25
    cpu_overhead_work: float = 2 ** 20

    def __post_init__(self) -> None:
        for name in ("factor", "launch_bound_factor", "launch_bound_work", "cpu_compute_factor",
                     "cpu_overhead_work"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 1:
                raise ValueError(f"WidthRule.{name} must be a number >= 1; got {value!r}")

    def limit(self, device_type: str, batch: int, padded: float) -> float:
        """The largest padded/own factor allowed for members whose padded model
        costs ``padded`` per sample, at ``batch`` rows a step."""
        work = batch * padded
        if device_type == "cuda" and work <= self.launch_bound_work:
            return max(self.factor, self.launch_bound_factor)
        if device_type == "cpu" and work > self.cpu_overhead_work:
            return min(self.factor, self.cpu_compute_factor)
        return self.factor  # a bigger GPU step, a CPU's overhead-bound one, any other device (not measured)

    def judge(self, own: Sequence[float], padded: float, device_type: str, batch: int) -> Verdict:
        """Whether members of costs ``own`` share a stack padded to cost ``padded``."""
        limit = self.limit(device_type, batch, padded)
        if not own:
            return Verdict(True, (), limit)
        factors = tuple(padded / max(c, 1e-12) for c in own)
        worst = max(range(len(own)), key=factors.__getitem__)
        if factors[worst] <= limit:
            return Verdict(True, factors, limit)
        return Verdict(False, factors, limit,
                       f"padded to the widest shapes, a member costing {own[worst]:.4g} would cost {padded:.4g} "
                       f"({factors[worst]:.3g}x its own; the limit on {device_type} is {limit:.3g}x for a padded "
                       f"step of {batch * padded:.3g} multiply-adds)")


# The rule a bucket follows unless told otherwise.
DEFAULT_RULE = WidthRule()
# For a bucket whose members were grouped by the rule already (the pool's WidthGroups):
# every stack of a group's members is within the limit, so the bucket does not judge again.
NO_LIMIT = WidthRule(factor=math.inf, launch_bound_factor=math.inf, cpu_compute_factor=math.inf)


@dataclass
class _Group:
    shapes: list[dict[str, Shape]] = field(default_factory=list)
    own: list[float | None] = field(default_factory=list)  # None: not priced yet
    widest: dict[str, Shape] = field(default_factory=dict)

    def priced(self, cost: Callable[[Shapes], float]) -> list[float]:
        self.own = [cost(s) if c is None else c for s, c in zip(self.shapes, self.own)]
        return self.own


class WidthGroups:
    """Sets of widths of one structure that may share padded stacks, assigned
    in the order they come (see the module's docstring). ``device_type``:
    the device the stacks run on (the rule's launch-bound factor)."""

    def __init__(self, rule: WidthRule = DEFAULT_RULE, device_type: str = "cpu"):
        self.rule, self.device_type = rule, device_type
        self._groups: dict[Hashable, list[_Group]] = {}
        self.reasons: dict[tuple[Hashable, int], str] = {}  # why each group after the first opened

    def assign(self, structure: Hashable, shapes: Shapes, cost: Callable[[Shapes], float], batch: int) -> int:
        """The group of a member of ``structure`` (a padded family's key) with
        tensors of ``shapes``, priced by ``cost(shapes)`` (every call for one
        structure must price alike; nothing is priced until a second set of
        widths comes); the same widths always get the same group."""
        groups = self._groups.setdefault(structure, [])
        own_shapes = {n: tuple(s) for n, s in shapes.items()}
        for i, group in enumerate(groups):
            if own_shapes in group.shapes:
                return i
        if not groups:
            # Priced only once other widths of its structure come: a price may
            # cost a data load (the pool's multiply-adds need an input row),
            # which a sweep of one width never needs.
            groups.append(_Group([own_shapes], [None], dict(own_shapes)))
            return 0
        own = cost(own_shapes)
        reason = ""
        for i, group in enumerate(groups):
            wide = widest([group.widest, own_shapes])
            verdict = self.rule.judge([*group.priced(cost), own], cost(wide), self.device_type, batch)
            if verdict.shares:
                group.shapes.append(own_shapes)
                group.own.append(own)
                group.widest = wide
                return i
            reason = reason or verdict.reason
        groups.append(_Group([own_shapes], [own], dict(own_shapes)))
        if reason:
            self.reasons[(structure, len(groups) - 1)] = reason
        return len(groups) - 1
