"""Ray's dashboard, seen in a real browser as a user sees it (docs/design.md D12).

Ray starts with its dashboard and, as Ray 2.60 does for a new local cluster,
token authentication. An 8-trial sweep trains in one bucket, kept alive after
it; headless Chromium logs in with the token that ``ray get-auth-token``
prints and opens the Actors page. The bucket's row must be
there and claim nothing its live state contradicts; the bucket's log, read
through the dashboard's log API, must say what the results say. The
screenshot is the guide's (docs/guide/watching.md) (``make screenshot`` writes it).

Skipped, saying why, where no Chromium binary is found.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import ray
from ray import tune
from ray.util.state import get_log, list_actors

from chorus_tune.tune import ChorusTrainable
from chorus_tune.tune.search.search import ChorusSearch
from chorus_tune.tune.values.protocol import NAMESPACE

from dashboard_support import TABLE_ROWS_JS, Chromium, find_chromium, login, trial_actors
from tune_support import digits_task, run_config

CHROMIUM = find_chromium()
pytestmark = [pytest.mark.ray, pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium binary found (apt-get install chromium, or set $CHROMIUM): "
                             "the dashboard is checked in a real browser only")]

TRIALS, BUCKET, ITERATIONS, BATCH = 8, 8, 3, 64
SCREEN = (1600, 760)  # the Actors page of one sweep fits; no empty page below it

# bucket_actor.STATUS_LINE, as a reader parses it.
STATUS = re.compile(r"(?P<bucket>\S+): iteration (?P<iteration>\d+), live (?P<in_slots>\d+)/(?P<capacity>\d+), "
                    r"trained (?P<trained>\d+), rows (?P<rows>\d+), route (?P<route>\w+), threads (?P<threads>\d+), "
                    r"(?P<seconds>[\d.]+) s, "
                    r"step (?P<step_ms>[\d.]+) ms, (?P<samples_per_s>\d+) samples/s, wasted (?P<wasted>\d+)$")
WASTED = re.compile(r"(?P<bucket>\S+): .*\bwasted (?P<wasted>\d+)$")
STARTED_FOR = re.compile(r"^ChorusTrainable\(started for trial (\S+)\)$")
SERVES = re.compile(r"trial (\S+) reads member \S+ in bucket (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def seen(observed_ray, tmp_path_factory):
    """The sweep, the live bucket, the trial actors the sweep started, and what
    the browser showed. The head (conftest.py) is shared with
    tests/test_tune_observability.py, whose sweep's actors may be there too."""
    head, _ = observed_ray
    dashboard, token = head.dashboard, head.token
    before = {a.actor_id for a in trial_actors(dashboard)}
    task = digits_task(batch_size=BATCH)
    # idle_close_s keeps the bucket alive after the sweep, to be looked at.
    trainable = ChorusTrainable.for_task(task, bucket_size=BUCKET, max_buckets=1, idle_close_s=300.0)
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(0.01, 0.3), "seed": tune.randint(0, 10_000)},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=TRIALS, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable, random_state=0)),
        # Tune's stop, not a budget the bucket knows: members run ahead of
        # their trials and what nobody reads is wasted (and reported).
        run_config=run_config(tmp_path_factory.mktemp("dashboard"), ITERATIONS),
    ).fit()
    assert not results.errors
    bucket = results[0].metrics["chorus/bucket"]
    handle = ray.get_actor(bucket, namespace=NAMESPACE)
    shot = tmp_path_factory.mktemp("screenshot") / "dashboard-actors.png"
    with Chromium(CHROMIUM, *SCREEN) as browser:
        status = login(browser, dashboard, token)
        browser.goto(f"{dashboard}/#/actors")
        browser.wait_for(f"document.body.innerText.includes({json.dumps(bucket)})", timeout_s=60)
        rows = browser.evaluate(TABLE_ROWS_JS)
        browser.screenshot(shot)
    live = ray.get(handle.describe.remote())
    started = [a for a in trial_actors(dashboard) if a.actor_id not in before]
    return {"results": results, "bucket": bucket, "live": live, "rows": rows, "login": status,
            "screenshot": shot, "dashboard": dashboard, "trial_actors": started}


def _table(rows: list[list[str]]) -> list[dict[str, str]]:
    header = next(r for r in rows if "Repr" in r and "Class" in r)
    return [dict(zip(header, r)) for r in rows if len(r) == len(header) and r != header]


def _actor_rows(seen, cls: str) -> list[dict[str, str]]:
    return [r for r in _table(seen["rows"]) if r["Class"] == cls]


def _trial_actor_rows(seen) -> list[dict[str, str]]:
    """The page's rows of the trial actors this sweep started (by PID: the
    shared head may hold another sweep's)."""
    pids = {str(a.pid) for a in seen["trial_actors"]}
    return [r for r in _actor_rows(seen, "ChorusTrainable") if r["PID"] in pids]


def _bucket_log(seen) -> list[str]:
    actor = next(a for a in list_actors(address=seen["dashboard"], filters=[("name", "=", seen["bucket"])]))
    # get_log takes the cluster's address and finds its dashboard (with the token).
    text = "".join(get_log(address=ray.get_runtime_context().gcs_address, actor_id=actor.actor_id, suffix="out",
                           tail=-1))
    return text.splitlines()


def test_the_dashboard_takes_the_token_that_ray_get_auth_token_prints(seen):
    assert seen["login"] == 200


def test_the_actors_page_shows_the_bucket_row_alive_under_its_name(seen):
    rows = [r for r in _actor_rows(seen, "ChorusBucket") if r["Name"] == seen["bucket"]]
    assert len(rows) == 1
    assert rows[0]["State"] == "ALIVE"


def test_the_bucket_row_claims_nothing_its_live_state_contradicts(seen):
    row = next(r for r in _actor_rows(seen, "ChorusBucket") if r["Name"] == seen["bucket"])
    live = seen["live"]
    # The repr is what the bucket says of itself now: what Ray captured at
    # creation has not gone stale. It names no count that changes.
    assert row["Repr"] == live["repr"]
    model, size, device = re.fullmatch(r"ChorusBucket\((\w+), bucket_size=(\d+), (\w+)\)", row["Repr"]).groups()
    assert (model, device) == (live["model"], live["device"])
    assert int(size) == BUCKET >= live["capacity"]
    assert not re.search(r"\d+/\d+|route", row["Repr"])
    assert (int(row["PID"]), row["Node ID"]) == (live["pid"], live["node_id"])


def test_each_trial_actor_row_names_a_trial_of_the_sweep(seen):
    trials = {r.metrics["trial_id"] for r in seen["results"]}
    reprs = [r["Repr"] for r in _trial_actor_rows(seen)]
    assert reprs and len(reprs) == len(seen["trial_actors"])  # each actor the sweep started has its row
    started_for = [STARTED_FOR.fullmatch(text) for text in reprs]
    assert all(started_for), reprs
    assert {m.group(1) for m in started_for} <= trials


def test_the_trial_actors_logs_name_every_trial_they_served_and_its_bucket(seen):
    # reuse_actors: an actor serves several trials, its repr names the first.
    served = {}
    for actor in seen["trial_actors"]:
        text = "".join(get_log(address=ray.get_runtime_context().gcs_address, actor_id=actor.actor_id, suffix="out",
                               tail=-1))
        served.update(dict(SERVES.findall(text)))
    assert served == {r.metrics["trial_id"]: seen["bucket"] for r in seen["results"]}


def test_the_bucket_log_has_a_status_line_for_each_iteration_in_order(seen):
    lines = [m for m in map(STATUS.search, _bucket_log(seen)) if m and m["bucket"] == seen["bucket"]]
    assert [int(m["iteration"]) for m in lines] == list(range(1, seen["live"]["iterations"] + 1))


def test_each_result_agrees_with_the_status_line_of_the_iteration_that_computed_it(seen):
    matches = map(STATUS.search, _bucket_log(seen))
    lines = {int(m["iteration"]): m for m in matches if m and m["bucket"] == seen["bucket"]}
    checked = 0
    for result in seen["results"]:
        for _, row in result.metrics_dataframe.iterrows():
            line = lines[int(row["chorus/bucket_iteration"])]
            assert int(line["trained"]) == row["chorus/live"]
            assert int(line["capacity"]) == row["chorus/capacity"]
            assert line["route"] == row["chorus/route"]
            assert int(line["trained"]) <= int(line["in_slots"]) <= int(line["capacity"])
            checked += 1
    assert checked == TRIALS * ITERATIONS


def test_a_status_line_s_samples_per_second_is_its_members_batches_over_its_step_time(seen):
    lines = [m for m in map(STATUS.search, _bucket_log(seen)) if m]
    assert lines
    for line in lines:
        expected = int(line["trained"]) * BATCH / (float(line["step_ms"]) / 1000)
        # Rounded as printed: step time to 0.01 ms, samples/s to 1.
        assert float(line["samples_per_s"]) == pytest.approx(expected, rel=0.02, abs=1)


def test_the_bucket_log_counts_the_wasted_iterations_the_bucket_counts(seen):
    counts = [int(m["wasted"]) for m in map(WASTED.search, _bucket_log(seen)) if m]
    assert counts == sorted(counts)  # a running total
    assert counts[-1] == seen["live"]["wasted"]


def test_the_screenshot_is_a_png_of_the_page_the_browser_showed(seen):
    from PIL import Image

    with Image.open(seen["screenshot"]) as image:
        assert image.format == "PNG"
        assert image.size == SCREEN
    target = os.environ.get("CHORUS_SCREENSHOT")
    if target:  # `make screenshot`: the guide's picture
        shutil.copyfile(seen["screenshot"], target)
