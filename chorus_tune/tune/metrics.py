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
        self.live = Gauge("chorus_live_members", "Members in the bucket's slots.", tag_keys=_TAGS)
        self.capacity = Gauge("chorus_capacity", "Slots of the bucket.", tag_keys=_TAGS)
        self.fused_steps = Counter("chorus_fused_steps", "Fused training steps run.", tag_keys=_TAGS)
        self.iterations = Counter("chorus_iterations", "Fused iterations run (each trains some or all members).",
                                  tag_keys=_TAGS)
        self.samples_per_s = Gauge("chorus_samples_per_second",
                                   "Training samples per second over all members, last iteration.",
                                   tag_keys=_TAGS)
        self.step_time = Gauge("chorus_step_time_seconds", "Seconds per fused step, last iteration.",
                               tag_keys=_TAGS)
        self.compactions = Counter("chorus_compactions", "Times the bucket shrank to its live members.",
                                   tag_keys=_TAGS)
        self.route = Gauge("chorus_route", "1 for the route the bucket runs (vmap or eager).",
                           tag_keys=_TAGS + ("route",))
        # A gauge of the running total, not a counter: Ray exports a counter
        # only once it is incremented, and "0 wasted" is worth a picture.
        self.wasted_iterations = Gauge("chorus_wasted_iterations",
                                       "Member-iterations the bucket computed that no trial read, so far.",
                                       tag_keys=_TAGS)
        for metric in (self.live, self.capacity, self.fused_steps, self.iterations, self.compactions,
                       self.samples_per_s, self.step_time, self.wasted_iterations):
            metric.set_default_tags(tags)
        self._tags = tags
        self.wasted(0)

    def members(self, live: int, capacity: int) -> None:
        """Members in slots now, of ``capacity`` slots."""
        self.live.set(live)
        self.capacity.set(capacity)

    def compacted(self, live: int, capacity: int) -> None:
        """The bucket shrank to ``capacity`` slots."""
        self.compactions.inc()
        self.members(live, capacity)

    def wasted(self, total: int) -> None:
        """The bucket's wasted member-iterations so far (counted when a member
        leaves with results nobody read)."""
        self.wasted_iterations.set(total)

    def iteration(self, steps: int, samples: int, seconds: float, route: str | None) -> None:
        """One iteration of ``steps`` fused steps over ``samples`` samples in ``seconds``."""
        self.iterations.inc()
        if steps:
            self.fused_steps.inc(steps)
            self.step_time.set(seconds / steps)
        if seconds > 0:
            self.samples_per_s.set(samples / seconds)
        for name in ROUTES:
            self.route.set(1.0 if name == route else 0.0, tags={**self._tags, "route": name})
