"""The quickstart example (``make demo``) runs end to end in its fast mode."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray  # starts Ray (conftest.py: `make test-core` leaves it out)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_fast_prints_best_config_accuracy_and_fusion():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--fast"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         # A Ray of its own: ray.init() would join a cluster an earlier test left.
                         env={**os.environ, "RAY_DEDUP_LOGS": "1", "RAY_ADDRESS": "local"})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "6 trials in" in text and "(0 errors)" in text
    assert "best config: {" in text and "best val_accuracy: 0." in text
    fused = [line for line in text.splitlines() if "trials fused" in line and "chorus-bucket-" in line]
    assert fused and sum(int(line.rsplit(",", 1)[1].split()[0]) for line in fused) >= 6
    assert "load_model -> Sequential" in text
