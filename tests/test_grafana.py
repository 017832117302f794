"""The Grafana dashboard of the ray_chorus_* metrics: shipped as built, laid out, installable.

tests/test_tune_observability.py checks against a live bucket that every
metric it reads is exported, and that it installs into a real Ray session.
"""
from __future__ import annotations

import json

import pytest

from chorus_tune.tune.observe import grafana
from chorus_tune.tune.observe import metrics as m


def test_the_shipped_json_is_the_dashboard_built_from_the_metric_names():
    assert grafana.shipped_path().read_text() == grafana.render()


def test_it_reads_only_metrics_a_bucket_defines():
    defined = {m.exported_name(n) for n in (m.LIVE_MEMBERS, m.CAPACITY, m.FUSED_STEPS, m.ITERATIONS,
                                             m.SAMPLES_PER_SECOND, m.STEP_TIME, m.COMPACTIONS, m.ROUTE, m.WASTED)}
    assert grafana.queried_metrics() == defined


def test_every_query_is_filtered_by_the_session_and_bucket_chosen():
    for panel in grafana.dashboard()["panels"]:
        for target in panel["targets"]:
            assert '{SessionName=~"$SessionName", bucket=~"$bucket"}' in target["expr"], panel["title"]
            assert target["datasource"]["uid"] == "${datasource}"


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = grafana.dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in panels
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))


def test_out_writes_the_dashboard_json(tmp_path):
    out = tmp_path / "dashboard.json"
    grafana.main(["--out", str(out)])
    assert json.loads(out.read_text()) == grafana.dashboard()


def test_install_refuses_where_ray_has_written_no_grafana_provisioning(tmp_path, monkeypatch):
    monkeypatch.delenv(grafana.RAY_DASHBOARDS_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="start Ray"):
        grafana.install(str(tmp_path))


def test_install_follows_rays_dashboard_folder_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(grafana.RAY_DASHBOARDS_ENV, str(tmp_path))
    assert grafana.install("/nonexistent") == tmp_path / grafana.FILE_NAME
    assert json.loads((tmp_path / grafana.FILE_NAME).read_text())["uid"] == grafana.UID
