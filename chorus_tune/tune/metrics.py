"""``ray.util.metrics`` of a bucket (docs/design.md D12): exported on Ray's metrics
endpoint as ``ray_chorus_*``, tagged with the bucket's name and model class."""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge

_TAGS = ("bucket", "model")
ROUTES = ("vmap", "eager")


class BucketMetrics:
    """The gauges and counters one bucket actor keeps up to date."""

    def __init__(self, bucket: str, model: str):
        tags = {"bucket": bucket, "model": model}
        self.live = Gauge("chorus_live_members", "Members training in the bucket.", tag_keys=_TAGS)
        self.capacity = Gauge("chorus_capacity", "Slots of the bucket.", tag_keys=_TAGS)
        self.fused_steps = Counter("chorus_fused_steps", "Fused training steps run.", tag_keys=_TAGS)
        self.iterations = Counter("chorus_iterations", "Lockstep iterations run.", tag_keys=_TAGS)
        self.samples_per_s = Gauge("chorus_samples_per_second",
                                   "Training samples per second over all members, last iteration.",
                                   tag_keys=_TAGS)
        self.step_time = Gauge("chorus_step_time_seconds", "Seconds per fused step, last iteration.",
                               tag_keys=_TAGS)
        self.compactions = Counter("chorus_compactions", "Times the bucket shrank to its live members.",
                                   tag_keys=_TAGS)
        self.route = Gauge("chorus_route", "1 for the route the bucket runs (vmap or eager).",
                           tag_keys=_TAGS + ("route",))
        for metric in (self.live, self.capacity, self.fused_steps, self.iterations, self.compactions,
                       self.samples_per_s, self.step_time):
            metric.set_default_tags(tags)
        self._tags = tags

    def members(self, live: int, capacity: int) -> None:
        self.live.set(live)
        self.capacity.set(capacity)

    def compacted(self, live: int, capacity: int) -> None:
        self.compactions.inc()
        self.members(live, capacity)

    def iteration(self, steps: int, samples: int, seconds: float, route: str | None) -> None:
        self.iterations.inc()
        if steps:
            self.fused_steps.inc(steps)
            self.step_time.set(seconds / steps)
        if seconds > 0:
            self.samples_per_s.set(samples / seconds)
        for name in ROUTES:
            self.route.set(1.0 if name == route else 0.0, tags={**self._tags, "route": name})
