"""What a member's run lets its bucket know in advance (docs/design.md D4): a value
every layer passes (the pool seats members with one, the bucket's rules read it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """What a member's run lets the bucket know in advance.

    ``run_ahead``: iterations a member may compute beyond what its trial asked
    for, when Tune makes decisions the bucket cannot see. ``budget``: the
    iteration at which the member is done (``None``: unknown). ``bucket_decides``:
    every decision up to ``budget`` is known to the bucket (the rungs below,
    or no decision at all: FIFO with a budget the user gave), so the member
    runs ahead without bound. ``rungs``: iterations at which a cohort is halved,
    keeping ``max(1, floor(n / reduction_factor))`` by ``sign * metric``
    (higher is better after the sign). ``speculate``: when Tune decides, train
    on to ``budget`` except past the decision points the bucket has learned
    (see the module docstring); else at most ``run_ahead`` beyond the ask.
    ``metric``/``sign`` also name the run's metric where Tune decides (the
    order in which waiting trials read an unsettled iteration,
    rules/read_order.py). ``stop_criteria``: ``(key, value)`` pairs of a stop dict; a result with
    ``result[key] >= value`` is the member's last (Tune's own rule,
    ``Trial.should_stop``). ``clear_after``: when speculating, an iteration is
    known clear of Tune's decisions once this many of the run's trials were
    continued past it and none of its stops made it a decision point
    (:class:`StopRecord`); no member is computed past an iteration not known
    clear before its own trial asks past it.
    """

    run_ahead: int = 2
    budget: int | None = None
    bucket_decides: bool = False
    rungs: tuple[int, ...] = ()
    reduction_factor: float = 4.0
    metric: str | None = None
    sign: float = 1.0
    speculate: bool = False
    stop_criteria: tuple[tuple[str, float], ...] = ()
    clear_after: int = 4

    def __post_init__(self) -> None:
        if self.clear_after < 1:
            raise ValueError(f"clear_after must be at least 1; got {self.clear_after}")
        if self.run_ahead < 0:
            raise ValueError(f"run_ahead must be 0 or more; got {self.run_ahead}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"an iteration budget must be at least 1; got {self.budget}")
        if self.rungs and self.metric is None:
            raise ValueError("rungs need the metric they are decided on")
        if self.bucket_decides and self.budget is None:
            raise ValueError("a bucket can only decide every step of a run whose budget it knows")
