"""The side-by-side benchmark runs end to end on a tiny sweep and writes what it promises.

Timings are never asserted (shared machines are noisy); only that every way ran
every trial and that the report holds the fields the README quotes.
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray  # starts Ray (conftest.py: `make test-core` leaves it out)

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_vs_tune_runs_every_way_and_writes_json_and_plot(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
           "RAY_ADDRESS": "local"}  # a Ray of its own: ray.init() would join a cluster an earlier test left
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "vs_tune.py"), "--workload", "digits-mlp64", "--trials", "4",
         "--epochs", "2", "--bucket-size", "4", "--repeats", "1", "--out", str(tmp_path), "--name", "smoke"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    (row,) = report["rows"]
    assert set(row["median_wall_s"]) == {"plain", "chorus", "lockstep", "fused"}
    for way, runs in row["runs"].items():
        assert [r["trials"] for r in runs] == [4], way
        assert not math.isnan(row["best"][way]), way
    assert row["plain_over_chorus"] > 0 and row["chorus_over_fused"] > 0 and row["plain_over_lockstep"] > 0
