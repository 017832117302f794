"""Options a ChorusTrainable passes to its pool and buckets (Ray-free)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from chorus_tune.seeds import chosen_seed
from chorus_tune.tune.values.plan import Plan

AUTO = "auto"
DEFAULT_BUCKET_SIZE = 16


@dataclass(frozen=True)
class BucketOptions:
    """How the buckets of one ChorusTrainable class behave.

    ``bucket_size``: slots per bucket, or ``"auto"``: measured on the
    bucket's device for each structure before its first bucket opens
    (:func:`chorus_tune.capacity.auto_capacity`: peak memory of real fused
    steps at a few small K, fitted as a + b*K, the largest K under
    ``memory_fraction`` of free memory), at most ``max_bucket_size``. On a
    CPU-only bucket without a ``memory_meter`` it is the documented fixed
    default, 16 (capped), with no measurement. ``memory_meter``: a callable
    ``device -> MemoryMeter`` used instead of CUDA's allocator statistics (a
    test's fake device, or a meter of your own). ``resources_per_bucket``: see
    :mod:`chorus_tune.tune.rules.resources` (``None``: one GPU where there are GPUs,
    else one CPU). ``route``: ``"auto" | "vmap" | "compiled" | "batched" | "eager"``.

    How far members train ahead of their trials (the rules, once:
    :mod:`chorus_tune.tune.rules.members`; why: docs/design.md D4):
    ``speculate`` (default True): where decisions are Tune's, members train
    on to the run's stop dict except past learnt decision points; ``False``:
    at most ``run_ahead`` beyond the ask everywhere. ``run_ahead``: iterations
    a member may compute beyond its trial's ask where nothing else bounds
    it; ``0`` is strict lockstep. ``max_iterations``: an iteration budget,
    which also says nothing else ends a trial early (not needed for speed).
    ``ahead_memory_mb``: every result waiting for its trial keeps the member's
    state of that iteration (so a checkpoint is exact); a member stops running
    ahead when its bucket's waiting states would pass this many MiB.

    ``gather_s``: an iteration waits at most this long for members whose trial
    is about to ask, or about to join (trials in step, or started together,
    train in one fused iteration); a member whose trial lagged is masked
    instead, never waited for, until it catches up.
    ``result_timeout_s``: a trial that waited this long for one result fails,
    saying so. ``reap_interval_s``: how often a bucket checks that the trial
    actors reading its members are alive (a dead one's member is dropped).
    ``idle_close_s``: an empty bucket is closed after this long (at once if a
    waiting member needs its resources). ``max_buckets``: at most this many
    buckets at once (``None``: as many as the resources hold). ``compact``: a
    bucket whose live members fall to half its slots or fewer, with no member
    of its key waiting, shrinks to them ``compact_after_s`` after a member
    left (a trial reusing the leaver's actor refills the slot instead).
    ``regroup``: when nothing of its key waits, a sparse bucket whose members
    all fit into the free slots of other buckets of their structure on its
    device moves them there and closes (survivors of rungs train together;
    cohorts never mix: :mod:`chorus_tune.tune.rules.regrouping`).
    ``solo``: where buckets share the machine's cores (no GPU, default
    ``resources_per_bucket``), a member that ChorusSearch seats with no other
    member of its structure beside it trains in its trial's own process, as
    plain Tune would train it, instead of in a bucket of its own
    (:mod:`chorus_tune.tune.rules.solo`); ``False``: it opens a bucket.
    ``solo_below``: there too (and with ``solo``), the pool measures once per
    structure how much faster its members train fused than alone, and where
    every structure measured in a seating gains less than this factor, their
    members train solo, each in its trial's own process, and the pool's log
    says so (:mod:`chorus_tune.tune.rules.fusion_verdicts`); ``None``: never
    measured, every structure shares buckets.
    """

    bucket_size: int | str = DEFAULT_BUCKET_SIZE
    resources_per_bucket: tuple[tuple[str, float], ...] | None = None
    route: str = "auto"
    run_ahead: int = 2
    speculate: bool = True
    max_iterations: int | None = None
    ahead_memory_mb: float = 1024.0
    gather_s: float = 0.5
    result_timeout_s: float = 600.0
    reap_interval_s: float = 1.0
    idle_close_s: float = 5.0
    max_buckets: int | None = None
    compact: bool = True
    compact_after_s: float = 1.0
    regroup: bool = True
    max_bucket_size: int | None = None
    memory_fraction: float = 0.8
    solo: bool = True
    solo_below: float | None = 1.3
    memory_meter: Callable[[Any], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.bucket_size != AUTO and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive int or 'auto'; got {self.bucket_size!r}")
        if self.max_bucket_size is not None and self.max_bucket_size < 1:
            raise ValueError(f"max_bucket_size must be positive; got {self.max_bucket_size}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1]; got {self.memory_fraction}")
        # chorus_tune.route.ROUTES, spelled out: this module is torch-free (trial actors import it).
        if self.route not in ("auto", "vmap", "compiled", "batched", "eager"):
            raise ValueError(f"route must be 'auto', 'vmap', 'compiled', 'batched' or 'eager'; got {self.route!r}")
        if self.run_ahead < 0:
            raise ValueError(f"run_ahead must be 0 or more; got {self.run_ahead}")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise ValueError(f"max_iterations must be positive; got {self.max_iterations}")
        if self.solo_below is not None and not self.solo_below > 0:
            raise ValueError(f"solo_below must be a positive factor or None; got {self.solo_below!r}")
        if self.ahead_memory_mb <= 0:
            raise ValueError(f"ahead_memory_mb must be positive; got {self.ahead_memory_mb}")

    @property
    def auto(self) -> bool:
        return self.bucket_size == AUTO

    @property
    def expected_size(self) -> int:
        """Slots per bucket to size other things by (Tune's trial tokens,
        ChorusSearch's look-ahead) before an ``"auto"`` size is measured: the
        cap, or the default size (the same 16 as ``chorus_tune.capacity``'s CPU
        default; not imported from there: trial actors import this module and
        must not load torch)."""
        if not self.auto:
            return self.bucket_size
        return self.max_bucket_size or DEFAULT_BUCKET_SIZE

    @staticmethod
    def resources(resources_per_bucket: dict | None) -> tuple[tuple[str, float], ...] | None:
        """The hashable form of a resources dict."""
        if resources_per_bucket is None:
            return None
        return tuple(sorted((str(k), float(v)) for k, v in resources_per_bucket.items()))

    def plan(self, schedule: "RungSchedule | None" = None, budget: int | None = None,
             stop_at: int | None = None, stop_criteria: tuple[tuple[str, float], ...] = (),
             clear_after: int = Plan.clear_after, rank: tuple[str, float] | None = None) -> Plan:
        """The member plan these options give, with a scheduler's rungs if any.

        ``budget``: an iteration budget given elsewhere (ChorusSearch), taking
        the place of ``max_iterations``. ``stop_at``: a ``training_iteration``
        stop of the run: nothing trains past it. Where Tune's scheduler decides
        the rest, members speculate up to it (``speculate``). ``stop_criteria``:
        the run's stop dict on other keys, checked by the bucket on each result.
        ``clear_after``: the trials seen continued past an iteration that clear
        it for speculation (at most the trials Tune runs at once, or FIFO waits
        for trials to end before its members may train on). ``rank``: the
        run's ``(metric, sign)`` where Tune decides (the order in which waiting
        trials read an unsettled iteration: rules/read_order.py); ``None``
        where the run names no metric.
        """
        budget = budget if budget is not None else self.max_iterations
        common = dict(run_ahead=self.run_ahead, speculate=self.speculate, stop_criteria=tuple(stop_criteria),
                      clear_after=clear_after)
        if schedule is not None:
            caps = [b for b in (budget, schedule.max_t, stop_at) if b is not None]
            return Plan(budget=min(caps), bucket_decides=True,
                        rungs=tuple(r for r in schedule.rungs if r < min(caps)),
                        reduction_factor=schedule.reduction_factor, metric=schedule.metric,
                        sign=schedule.sign, **common)
        if rank is not None:
            common.update(metric=rank[0], sign=rank[1])
        if budget is not None:
            if stop_at is not None:
                budget = min(budget, stop_at)
            return Plan(budget=budget, bucket_decides=True, **common)
        return Plan(budget=stop_at, **common)


@dataclass(frozen=True)
class RungSchedule:
    """What ChorusASHA lets buckets decide themselves: its rungs (in
    ``training_iteration``), ``max_t``, and the metric they are judged on
    (``sign`` is +1 for ``mode="max"``, -1 for ``"min"``)."""

    rungs: tuple[int, ...]
    max_t: int
    reduction_factor: float
    metric: str
    sign: float


@dataclass(frozen=True)
class Join:
    """What a member enters its bucket with: its config, seed, plan and,
    when it resumes, its member state (serialised, opaque here). ``cohort``:
    the cohort token of a member moved in from another bucket (regrouping.py);
    ``held_at``: the rung it was held at there, alone, waiting for its trial."""

    config: dict = field(hash=False)
    seed: int
    state: bytes | None = None
    plan: Plan = field(default_factory=Plan)
    cohort: str | None = None
    held_at: int | None = None


def derived_seed(trial_id: str) -> int:
    """A trial's member seed when its config has none: stable for the trial id."""
    return int(hashlib.sha256(trial_id.encode()).hexdigest()[:8], 16) % (2**31)


def member_seed(config: dict, trial_id: str) -> int:
    return chosen_seed(config, otherwise=lambda: derived_seed(trial_id))
