"""``ray.util.metrics`` of a bucket (docs/design.md D12): exported on Ray's metrics
endpoint as ``ray_chorus_*`` (counters as ``ray_chorus_*_total``), tagged with
the bucket's name and model class. :mod:`chorus_tune.tune.observe.grafana` draws them."""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge

_TAGS = ("bucket", "model")
ROUTES = ("vmap", "batched", "eager", "unfused")

# The names, without Ray's "ray_" prefix (and a counter's "_total" suffix).
LIVE_MEMBERS = "chorus_live_members"
CAPACITY = "chorus_capacity"
FUSED_STEPS = "chorus_fused_steps"
ITERATIONS = "chorus_iterations"
SAMPLES_PER_SECOND = "chorus_samples_per_second"
STEP_TIME = "chorus_step_time_seconds"
COMPACTIONS = "chorus_compactions"
ROUTE = "chorus_route"
WASTED = "chorus_wasted_iterations"
COUNTERS = (FUSED_STEPS, ITERATIONS)


def exported_name(name: str) -> str:
    """The name Prometheus sees for metric ``name``."""
    return f"ray_{name}_total" if name in COUNTERS else f"ray_{name}"


class BucketMetrics:
    """The gauges and counters one bucket actor keeps up to date."""

    def __init__(self, bucket: str, model: str):
        tags = {"bucket": bucket, "model": model}
        self.live = Gauge(LIVE_MEMBERS, "Members in the bucket's slots.", tag_keys=_TAGS)
        self.capacity = Gauge(CAPACITY, "Slots of the bucket.", tag_keys=_TAGS)
        self.fused_steps = Counter(FUSED_STEPS, "Fused training steps run.", tag_keys=_TAGS)
        self.iterations = Counter(ITERATIONS, "Fused iterations run (each trains some or all members).",
                                  tag_keys=_TAGS)
        self.samples_per_s = Gauge(SAMPLES_PER_SECOND,
                                   "Training samples per second over all members, last iteration.",
                                   tag_keys=_TAGS)
        self.step_time = Gauge(STEP_TIME, "Seconds per fused step, last iteration.",
                               tag_keys=_TAGS)
        # Running totals as gauges, not counters: Ray exports a counter only
        # once it is incremented, and "none yet" is worth a picture.
        self.compactions = Gauge(COMPACTIONS, "Times the bucket shrank to its live members, so far.",
                                 tag_keys=_TAGS)
        self.route = Gauge(ROUTE, "1 for the route the bucket runs (vmap or eager).",
                           tag_keys=_TAGS + ("route",))
        self.wasted_iterations = Gauge(WASTED,
                                       "Member-iterations the bucket computed that no trial read, so far.",
                                       tag_keys=_TAGS)
        for metric in (self.live, self.capacity, self.fused_steps, self.iterations, self.compactions,
                       self.samples_per_s, self.step_time, self.wasted_iterations):
            metric.set_default_tags(tags)
        self._tags = tags
        self._compactions = 0
        # Each gauge's last value, per tag set: refresh() sets them again.
        self._last: dict[tuple, tuple[Gauge, float, dict | None]] = {}
        self._set(self.compactions, 0)
        self.wasted(0)

    def _set(self, gauge: Gauge, value: float, tags: dict | None = None) -> None:
        gauge.set(value, tags=tags)  # tags=None: the gauge's default tags (Ray's own default)
        self._last[(id(gauge), tuple(sorted((tags or {}).items())))] = (gauge, value, tags)

    def refresh(self) -> None:
        """Set every gauge again to its last value. Ray exports a gauge only
        when it is set, and its agent soon drops a value it does not hear
        again: measured in a local Ray (1 s reports), an idle bucket's gauges
        were still on the metrics endpoint 3 s after its last update and gone
        at 20 s, its counters kept. Grafana's panels then lost the idle bucket
        (live members 0, its slots). The bucket calls this every reap interval."""
        for gauge, value, tags in self._last.values():
            gauge.set(value, tags=tags)

    def members(self, live: int, capacity: int) -> None:
        """Members in slots now, of ``capacity`` slots."""
        self._set(self.live, live)
        self._set(self.capacity, capacity)

    def compacted(self, live: int, capacity: int) -> None:
        """The bucket shrank to ``capacity`` slots."""
        self._compactions += 1
        self._set(self.compactions, self._compactions)
        self.members(live, capacity)

    def wasted(self, total: int) -> None:
        """The bucket's wasted member-iterations so far (counted when a member
        leaves with results nobody read)."""
        self._set(self.wasted_iterations, total)

    def iteration(self, steps: int, samples: int, seconds: float, route: str | None) -> None:
        """One iteration of ``steps`` fused steps over ``samples`` samples in ``seconds``."""
        self.iterations.inc()
        if steps:
            self.fused_steps.inc(steps)
            self._set(self.step_time, seconds / steps)
        if seconds > 0:
            self._set(self.samples_per_s, samples / seconds)
        for name in ROUTES:
            self._set(self.route, 1.0 if name == route else 0.0, tags={**self._tags, "route": name})
