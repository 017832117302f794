"""Buckets are visible: named actors in the state API, metrics on Ray's metrics endpoint (docs/design.md D12)."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import ray
from ray import tune
from ray.util.state import list_actors

from chorus_tune.tune import ChorusTrainable
from tune_support import digits_task, run_config, start_ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    port = _free_port()
    context = start_ray(num_cpus=2, include_dashboard=True, _metrics_export_port=port,
                        _system_config={"metrics_report_interval_ms": 1000})
    # idle_close_s keeps the bucket alive after the sweep, to be inspected.
    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=4, idle_close_s=120.0)
    results = tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.05, 0.1])},
                         tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
                         run_config=run_config(tmp_path_factory.mktemp("obs"), 3)).fit()
    yield port, results, f"http://{context.dashboard_url}"
    ray.shutdown()


def test_buckets_are_named_actors_whose_repr_holds_only_what_never_changes(sweep):
    _, results, dashboard = sweep
    bucket = results[0].metrics["chorus/bucket"]
    actors = list_actors(address=dashboard, filters=[("class_name", "=", "ChorusBucket")], detail=True)
    ours = [a for a in actors if a.name == bucket]
    assert len(ours) == 1 and ours[0].state == "ALIVE"
    # Ray captures a repr once, at creation: live state would go stale there.
    assert ours[0].repr_name == "ChorusBucket(Sequential, 4 slots, cpu)"


def test_trial_actors_show_as_chorus_trainable(sweep):
    actors = list_actors(address=sweep[2], filters=[("class_name", "=", "ChorusTrainable")], detail=False)
    assert len(actors) >= 2


def test_bucket_metrics_reach_the_metrics_endpoint(sweep):
    port, results, _ = sweep
    bucket = results[0].metrics["chorus/bucket"]
    wanted = ["ray_chorus_live_members", "ray_chorus_fused_steps", "ray_chorus_samples_per_second",
              "ray_chorus_step_time_seconds", "ray_chorus_route"]
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        lines = [line for line in text.splitlines() if f'bucket="{bucket}"' in line]
        if all(any(line.startswith(w) for line in lines) for w in wanted):
            break
        time.sleep(1)
    lines = [line for line in text.splitlines() if f'bucket="{bucket}"' in line]
    missing = [w for w in wanted if not any(line.startswith(w) for line in lines)]
    assert not missing, f"not exported: {missing}"
    steps = [line for line in lines if line.startswith("ray_chorus_fused_steps")]
    assert float(steps[0].rsplit(" ", 1)[1]) > 0
    route = [line for line in lines if line.startswith("ray_chorus_route") and line.endswith(" 1.0")]
    assert len(route) == 1 and results[0].metrics["chorus/route"] in route[0]
