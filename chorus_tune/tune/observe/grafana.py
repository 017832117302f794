"""A Grafana dashboard of the buckets' ``ray_chorus_*`` metrics (docs/design.md D12).

Ray's own metrics become pictures only through Prometheus and Grafana, and so
do a bucket's: live members against slots, samples/s, step time, wasted
member-iterations, route, iterations and compactions, per bucket. The
dashboard is built here from the metric names of :mod:`.metrics`, and shipped
as ``chorus_tune/data_files/chorus_tune_grafana_dashboard.json`` (a test keeps
the two equal).

Ray writes Grafana's provisioning for its own dashboards into its session
(``/tmp/ray/session_latest/metrics/grafana``): a Grafana started with that
``grafana.ini`` loads every JSON in its ``dashboards`` folder. ::

    python -m chorus_tune.tune.observe.grafana --install   # copy ours beside Ray's, after Ray started
    python -m chorus_tune.tune.observe.grafana --out FILE  # or write it anywhere, to import by hand
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from chorus_tune.tune.observe import metrics as m

FILE_NAME = "chorus_tune_grafana_dashboard.json"
UID = "chorus-tune-buckets"
# Ray's variable for where its dashboards go (ray/dashboard/modules/metrics/metrics_head.py).
RAY_DASHBOARDS_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"
_FILTER = '{SessionName=~"$SessionName", bucket=~"$bucket"}'


def _q(name: str) -> str:
    return m.exported_name(name) + _FILTER


def _target(expr: str, legend: str, ref: str, instant: bool = False) -> dict[str, Any]:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
            "legendFormat": legend, "refId": ref, "instant": instant, "range": not instant}


def _panel(ident: int, title: str, description: str, targets: list[dict], unit: str = "short",
           kind: str = "timeseries", options: dict | None = None) -> dict[str, Any]:
    # Two columns of 12 x 8, in order.
    x, y = 12 * ((ident - 1) % 2), 8 * ((ident - 1) // 2)
    return {"id": ident, "type": kind, "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
            "options": options or {"legend": {"displayMode": "list", "placement": "bottom"},
                                   "tooltip": {"mode": "multi"}},
            "targets": targets}


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, one per question a user asks of a sweep."""
    return [
        _panel(1, "Live members per bucket",
               "Members in each bucket's slots, against its slots (fewer after a compaction).",
               [_target(_q(m.LIVE_MEMBERS), "{{bucket}} live", "A"),
                _target(_q(m.CAPACITY), "{{bucket}} slots", "B")]),
        _panel(2, "Samples per second",
               "Training samples per second over all members of a bucket, last iteration; and over all buckets.",
               [_target(_q(m.SAMPLES_PER_SECOND), "{{bucket}}", "A"),
                _target(f"sum({_q(m.SAMPLES_PER_SECOND)})", "all buckets", "B")]),
        _panel(3, "Step time", "Seconds per fused step (an iteration's time over its steps), last iteration.",
               [_target(_q(m.STEP_TIME), "{{bucket}}", "A")], unit="s"),
        _panel(4, "Wasted member-iterations",
               "Member-iterations a bucket computed that no trial read (members run ahead of their trials "
               "within run_ahead when only Tune knows when a trial stops), so far.",
               [_target(_q(m.WASTED), "{{bucket}}", "A")]),
        _panel(5, "Route", "How each bucket's fused step runs now: vmap, or eager where vmap failed its probe.",
               [_target(f"max by (bucket, route) ({_q(m.ROUTE)}) == 1", "{{bucket}}: {{route}}", "A",
                        instant=True)],
               kind="stat", options={"textMode": "name", "colorMode": "none", "graphMode": "none",
                                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
        _panel(6, "Iterations and fused steps per second",
               "How fast each bucket goes through iterations and through fused steps.",
               [_target(f"rate({_q(m.ITERATIONS)}[$__rate_interval])", "{{bucket}} iterations/s", "A"),
                _target(f"rate({_q(m.FUSED_STEPS)}[$__rate_interval])", "{{bucket}} steps/s", "B")]),
        _panel(7, "Compactions", "Times a bucket shrank to its live members.",
               [_target(_q(m.COMPACTIONS), "{{bucket}}", "A")]),
    ]


def _variable(name: str, query: str, description: str) -> dict[str, Any]:
    return {"name": name, "type": "query", "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "definition": query, "query": {"query": query, "refId": "StandardVariableQuery"},
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0}


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard, as Grafana's JSON model."""
    capacity = m.exported_name(m.CAPACITY)
    return {
        "uid": UID, "title": "chorus_tune buckets", "tags": ["chorus_tune", "ray"],
        "description": "The buckets of chorus_tune sweeps: what Ray's own dashboards do not show.",
        "schemaVersion": 27, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            # Ray's provisioning names its Prometheus data source; any other one can be picked.
            {"name": "datasource", "type": "datasource", "query": "prometheus", "hide": 0,
             "current": {}, "description": "The Prometheus that scrapes Ray."},
            _variable("SessionName", f"label_values({capacity}, SessionName)", "The Ray session(s) to show."),
            _variable("bucket", f'label_values({capacity}{{SessionName=~"$SessionName"}}, bucket)',
                      "The bucket(s) to show."),
        ]},
        "annotations": {"list": []},
        "panels": panels(),
    }


def queried_metrics(model: dict[str, Any] | None = None) -> set[str]:
    """Every metric name the dashboard's queries read."""
    import re

    model = dashboard() if model is None else model
    exprs = [t["expr"] for p in model["panels"] for t in p["targets"]]
    return {name for e in exprs for name in re.findall(r"\bray_chorus_\w+", e)}


def shipped_path() -> Path:
    """The dashboard JSON shipped inside the package."""
    return Path(str(resources.files("chorus_tune") / "data_files" / FILE_NAME))


def render() -> str:
    """The dashboard as the JSON text that is shipped."""
    return json.dumps(dashboard(), indent=2) + "\n"


def ray_dashboards_dir(ray_temp_dir: str = "/tmp/ray") -> Path:
    """Where the latest Ray session's Grafana provisioning loads dashboards from."""
    if os.environ.get(RAY_DASHBOARDS_ENV):
        return Path(os.environ[RAY_DASHBOARDS_ENV])
    return Path(ray_temp_dir) / "session_latest" / "metrics" / "grafana" / "dashboards"


def install(ray_temp_dir: str = "/tmp/ray") -> Path:
    """Copy the dashboard beside Ray's own in its latest session. Ray rewrites
    that folder whenever it starts: install after ``ray start`` or
    ``ray.init()``, before starting Grafana."""
    target = ray_dashboards_dir(ray_temp_dir)
    if not target.is_dir():
        raise FileNotFoundError(f"{target} does not exist: start Ray (with ray[default]) first")
    destination = target / FILE_NAME
    shutil.copyfile(shipped_path(), destination)
    return destination


def main(argv: list[str] | None = None) -> None:
    """``python -m chorus_tune.tune.observe.grafana``: write or install the dashboard."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the dashboard JSON to this file")
    parser.add_argument("--install", action="store_true",
                        help="copy it into the latest Ray session's Grafana dashboards folder")
    parser.add_argument("--ray-temp-dir", default="/tmp/ray", help="Ray's temp dir (default /tmp/ray)")
    args = parser.parse_args(argv)
    if not (args.out or args.install):
        print(shipped_path())
    if args.out:
        Path(args.out).write_text(render())
        print(args.out)
    if args.install:
        print(install(args.ray_temp_dir))


if __name__ == "__main__":
    main()
