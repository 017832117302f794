"""Every result says why its bucket runs the route it runs (``chorus/route_reason``), and the
bucket's description holds the route report, with the probe's timings."""
from __future__ import annotations

import asyncio

import pytest
from test_bucket_actor import make_bucket, seat

from chorus_tune.route import RouteReason
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.plan import Plan

pytestmark = pytest.mark.usefixtures("local_ray")  # the bucket's metrics need a Ray instance


@pytest.mark.parametrize("route, reason", [("auto", RouteReason.FASTER), ("eager", RouteReason.REQUESTED)])
def test_every_result_carries_the_route_reason(route, reason):
    async def scenario():
        bucket = make_bucket(2, route=route)
        await seat(bucket, "ab", Plan(budget=2, bucket_decides=True))
        results = [await bucket.next_result(m) for m in "abab"]
        return results, (await bucket.describe())["route_report"]

    results, report = asyncio.run(scenario())
    assert report["reason"] == reason.value
    # an MLP: chorus_tune/batched.py accepts it, so the probe times the batched route too
    assert set(report["seconds"]) == ({"eager", "vmap", "batched"} if route == "auto" else set())
    for result in results:
        assert result[rk.ROUTE_REASON] == reason.value and result[rk.ROUTE] == report["route"]
