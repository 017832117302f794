"""Options a ChorusTrainable passes to its pool and buckets (Ray-free)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BucketOptions:
    """How the buckets of one ChorusTrainable class behave.

    ``bucket_size``: slots per bucket. ``resources_per_bucket``: see
    :mod:`chorus_tune.tune.resources` (``None``: one GPU where there are GPUs,
    else one CPU). ``route``: ``"auto" | "vmap" | "eager"``. ``gather_s``: how
    long a bucket with free slots waits after a newcomer for more (trials that
    Tune starts together then train together from their first iteration).
    ``park_after_s``: a member that has not asked for the next iteration this
    long after the others is parked (its state kept, its slot freed) so they
    go on; it rejoins, unchanged, when it asks (Tune may keep a stopped trial's
    actor for reuse without telling it). ``None`` never parks.
    ``lockstep_timeout_s``: a wait that still cannot complete after this long
    fails, naming the missing members. ``reap_interval_s``: how often a
    waiting bucket checks that missing members' trial actors are alive.
    ``idle_close_s``: an empty bucket is closed after this long (at once if a
    waiting trial needs its resources). ``max_buckets``: at most this many
    buckets at once (``None``: as many as the resources hold). ``compact``:
    a bucket whose live members fall to half its slots or fewer, with no trial
    of its key waiting, shrinks to them (finished slots stop costing compute),
    ``compact_after_s`` after a member left (a trial reusing the leaver's actor
    rejoins at once, and refills rather than finds the bucket shrunk).
    """

    bucket_size: int = 16
    resources_per_bucket: tuple[tuple[str, float], ...] | None = None
    route: str = "auto"
    gather_s: float = 0.5
    park_after_s: float | None = 2.0
    lockstep_timeout_s: float = 600.0
    reap_interval_s: float = 0.5
    idle_close_s: float = 5.0
    max_buckets: int | None = None
    compact: bool = True
    compact_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size must be positive; got {self.bucket_size}")
        if self.route not in ("auto", "vmap", "eager"):
            raise ValueError(f"route must be 'auto', 'vmap' or 'eager'; got {self.route!r}")

    @staticmethod
    def resources(resources_per_bucket: dict | None) -> tuple[tuple[str, float], ...] | None:
        """The hashable form of a resources dict."""
        if resources_per_bucket is None:
            return None
        return tuple(sorted((str(k), float(v)) for k, v in resources_per_bucket.items()))


@dataclass(frozen=True)
class Join:
    """What a trial brings to its bucket on its first request: its config,
    seed and, when it resumes, its member state (serialised, opaque here)."""

    config: dict = field(hash=False)
    seed: int
    state: bytes | None = None


def derived_seed(trial_id: str) -> int:
    """A trial's member seed when its config has none: stable for the trial id."""
    return int(hashlib.sha256(trial_id.encode()).hexdigest()[:8], 16) % (2**31)


def member_seed(config: dict, trial_id: str) -> int:
    return int(config["seed"]) if config.get("seed") is not None else derived_seed(trial_id)
