"""A bucket's gauges (chorus_tune.tune.observe.metrics), with Ray's metric classes replaced: no Ray runs."""
from __future__ import annotations

import pytest

from chorus_tune.tune.observe import metrics


class _Recorded:
    """Stands in for ``ray.util.metrics.Gauge`` and ``Counter``: records every value set."""

    sets: list[tuple[str, float, tuple]] = []

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.default = name, {}

    def set_default_tags(self, tags):
        self.default = dict(tags)

    def set(self, value, tags=None):
        _Recorded.sets.append((self.name, value, tuple(sorted({**self.default, **(tags or {})}.items()))))

    def inc(self, value=1.0, tags=None):
        pass


@pytest.fixture
def bucket_metrics(monkeypatch):
    monkeypatch.setattr(metrics, "Gauge", _Recorded)
    monkeypatch.setattr(metrics, "Counter", _Recorded)
    _Recorded.sets = []
    return metrics.BucketMetrics("b1", "MLP")


def test_refresh_sets_every_gauge_again_to_its_last_value_route_tags_included(bucket_metrics):
    bucket_metrics.members(3, 4)
    bucket_metrics.iteration(steps=10, samples=640, seconds=0.5, route="eager")
    bucket_metrics.members(2, 4)
    bucket_metrics.compacted(2, 2)
    bucket_metrics.wasted(5)
    last = {(name, tags): value for name, value, tags in _Recorded.sets}  # the later set of a series wins
    _Recorded.sets = []
    bucket_metrics.refresh()
    again = {(name, tags): value for name, value, tags in _Recorded.sets}
    assert again == last and len(_Recorded.sets) == len(last)  # each gauge and tag set once, at its last value
    assert again[(metrics.LIVE_MEMBERS, (("bucket", "b1"), ("model", "MLP")))] == 2
    assert again[(metrics.CAPACITY, (("bucket", "b1"), ("model", "MLP")))] == 2
    assert again[(metrics.ROUTE, (("bucket", "b1"), ("model", "MLP"), ("route", "eager")))] == 1.0
    assert again[(metrics.ROUTE, (("bucket", "b1"), ("model", "MLP"), ("route", "vmap")))] == 0.0
