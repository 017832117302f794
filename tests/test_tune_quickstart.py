"""The quickstart example (``make demo``) runs end to end in its fast mode."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_fast_prints_best_config_accuracy_and_fusion(script_ray_env):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--fast"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         # The suite's Ray (conftest.py), as `make demo` would join a running one.
                         env={**os.environ, "RAY_DEDUP_LOGS": "1", **script_ray_env})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "6 trials in" in text and "(0 errors)" in text
    assert "best config: {" in text and "best val_accuracy: 0." in text
    fused = [line for line in text.splitlines() if "trials fused" in line and "chorus-bucket-" in line]
    assert fused and sum(int(line.rsplit(",", 1)[1].split()[0]) for line in fused) >= 6
    assert "load_model -> Sequential" in text
