"""Every example runs, in its fast mode, as a user would start it (the quickstart: test_tune_quickstart.py)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, expected", [
    ("optuna_search.py", "best val_loss"),
    ("pbt.py", "load_model -> Sequential"),
    ("cnn_batchnorm.py", "load_model -> DigitsCNN, eval mode: True"),
    ("regression_mae.py", "best val_mae"),
])
def test_example_runs_in_fast_mode(script, expected, tmp_path, script_ray_env):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
           **script_ray_env}  # the suite's Ray (conftest.py)
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--fast"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert expected in done.stdout
    assert re.search(r"[\s(]0 errors", done.stdout), done.stdout[-2000:]


def test_core_demo_runs():
    done = subprocess.run([sys.executable, str(EXAMPLES / "core_demo.py")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "16 members x 10 epochs" in done.stdout
