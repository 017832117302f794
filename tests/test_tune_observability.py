"""Buckets are visible: named actors in the state API, status lines in their logs, metrics on Ray's
metrics endpoint (docs/design.md D12). tests/test_dashboard_browser.py looks at the same in a browser."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import ray
from ray import tune
from ray.util.state import get_log, list_actors

from chorus_tune.tune import ChorusTrainable
from chorus_tune.tune.observe import grafana

from dashboard_support import free_port, trial_actors
from tune_support import digits_task, run_config

pytestmark = pytest.mark.ray  # starts Ray (conftest.py: `make test-core` leaves it out)


@pytest.fixture(scope="module")
def sweep(observed_ray, tmp_path_factory):
    """The sweep on the observed head (conftest.py), which the browser's module
    shares; last, the trial actors this sweep started."""
    head, port = observed_ray
    before = {a.actor_id for a in trial_actors(head.dashboard)}
    # idle_close_s keeps the bucket alive after the sweep, to be inspected.
    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=4, idle_close_s=120.0)
    results = tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.05, 0.1])},
                         tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
                         run_config=run_config(tmp_path_factory.mktemp("obs"), 3)).fit()
    started = [a for a in trial_actors(head.dashboard) if a.actor_id not in before]
    yield port, results, head.dashboard, head.temp_dir, started


def test_buckets_are_named_actors_whose_repr_holds_only_what_never_changes(sweep):
    _, results, dashboard, *_ = sweep
    bucket = results[0].metrics["chorus/bucket"]
    actors = list_actors(address=dashboard, filters=[("class_name", "=", "ChorusBucket")], detail=True)
    ours = [a for a in actors if a.name == bucket]
    assert len(ours) == 1 and ours[0].state == "ALIVE"
    # Ray captures a repr once, at creation: live state would go stale there.
    assert ours[0].repr_name == "ChorusBucket(Sequential, bucket_size=4, cpu)"


def test_trial_actors_show_as_chorus_trainable_naming_the_trial_each_started_for(sweep):
    _, results, _, _, actors = sweep
    # No reuse_actors here: one actor per trial.
    assert sorted(a.repr_name for a in actors) == sorted(f"ChorusTrainable(started for trial {r.metrics['trial_id']})"
                                                         for r in results)


def test_the_bucket_log_has_a_status_line_per_iteration(sweep):
    _, results, dashboard, *_ = sweep
    bucket = results[0].metrics["chorus/bucket"]
    actor = list_actors(address=dashboard, filters=[("name", "=", bucket)])[0]
    text = "".join(get_log(address=ray.get_runtime_context().gcs_address, actor_id=actor.actor_id, suffix="out",
                          tail=-1))
    status = re.compile(rf"{re.escape(bucket)}: iteration (\d+), live \d+/\d+, trained \d+, rows \d+, route [\w+]+, ")
    iterations = [int(m.group(1)) for m in map(status.search, text.splitlines()) if m]
    last = max(int(v) for r in results for v in r.metrics_dataframe["chorus/bucket_iteration"])
    assert iterations[:last] == list(range(1, last + 1))


def _exported(port: int, bucket: str, wanted: set[str], shows=None) -> list[str]:
    """The metric lines of ``bucket`` on the endpoint, once all of ``wanted``
    are there and ``shows(lines)`` holds (or after 60 s).

    ``shows``: the endpoint lags the bucket by up to a report interval (1 s
    here) and its agent's export, and a bucket process that trained before
    this sweep has its series there already, with the earlier values: measured
    with a bucket that took a second key, the first reading after the sweep
    still said route vmap and 3 iterations, the next (2 s later) eager and 7.
    """
    deadline, lines = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        lines = [line for line in text.splitlines() if f'bucket="{bucket}"' in line]
        if _names(lines) >= wanted and (shows is None or shows(lines)):
            break
        time.sleep(1)
    return lines


def _names(lines: list[str]) -> set[str]:
    """The metric names of endpoint lines."""
    return {line.split("{", 1)[0] for line in lines}


def _routes_on(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("ray_chorus_route") and line.endswith(" 1.0")]


def test_bucket_metrics_reach_the_metrics_endpoint(sweep):
    port, results, *_ = sweep
    bucket, route = results[0].metrics["chorus/bucket"], results[0].metrics["chorus/route"]
    wanted = {"ray_chorus_live_members", "ray_chorus_fused_steps_total", "ray_chorus_samples_per_second",
              "ray_chorus_step_time_seconds", "ray_chorus_route", "ray_chorus_wasted_iterations"}
    lines = _exported(port, bucket, wanted, shows=lambda lines: any(f'route="{route}"' in line
                                                                    for line in _routes_on(lines)))
    missing = wanted - _names(lines)
    assert not missing, f"not exported: {missing}"
    steps = [line for line in lines if line.startswith("ray_chorus_fused_steps")]
    assert float(steps[0].rsplit(" ", 1)[1]) > 0
    on = _routes_on(lines)
    assert len(on) == 1 and f'route="{route}"' in on[0], on


def test_every_metric_the_grafana_dashboard_reads_is_exported_by_a_live_bucket(sweep):
    port, results, *_ = sweep
    wanted = grafana.queried_metrics()
    lines = _exported(port, results[0].metrics["chorus/bucket"], wanted)
    assert wanted <= _names(lines)


def test_the_grafana_dashboard_installs_beside_rays_own_in_the_running_session(sweep):
    _, _, _, temp_dir, _ = sweep
    installed = grafana.install(temp_dir)
    # Ray's own dashboards are provisioned from the same folder.
    assert any(p.name.startswith("default_grafana_dashboard") for p in installed.parent.iterdir())
    assert json.loads(installed.read_text())["uid"] == grafana.UID


PROMETHEUS = shutil.which("prometheus")


def _prometheus_query(web: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus): the Grafana "
                                               "dashboard's queries are run by a real Prometheus only")
def test_every_grafana_query_finds_the_bucket_in_a_prometheus_that_scrapes_ray(sweep, tmp_path):
    port, results, *_ = sweep
    bucket = results[0].metrics["chorus/bucket"]
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n- job_name: ray\n  static_configs:\n"
                      f"  - targets: ['127.0.0.1:{port}']\n")
    web = free_port()
    server = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # What Grafana substitutes for the dashboard's variables (this bucket, any session).
    exprs = [t["expr"].replace("$SessionName", ".*").replace("$bucket", bucket)
             .replace("$__rate_interval", "30s") for p in grafana.dashboard()["panels"] for t in p["targets"]]
    try:
        found: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(found) < len(exprs):
            for expr in exprs:
                try:
                    series = _prometheus_query(web, expr)
                except urllib.error.HTTPError as exc:
                    # 503: listening, not ready yet (measured: between the first
                    # connection it accepts and the first answer; a clean CI run
                    # under load met it). Any other status: it refused the query.
                    if exc.code != 503:
                        raise
                    series = []
                except OSError:
                    series = []  # not up yet
                if series:
                    found[expr] = series
            time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert set(found) == set(exprs), f"no series for: {set(exprs) - set(found)}"
    for expr, series in found.items():
        # Every query's series are this bucket's (sum() over buckets has no bucket label).
        assert all(s["metric"].get("bucket", bucket) == bucket for s in series), expr
