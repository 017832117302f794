"""Every example runs, in its fast mode, as a user would start it: the quickstart
(``make demo``) and the five others, each a Tune driver of its own joining the
suite's Ray (conftest.py), and the Ray-free core demo."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FAST_EXAMPLES = {  # script: what its output must say
    "optuna_search.py": "best val_loss",
    "pbt.py": "load_model -> Sequential",
    "cnn_batchnorm.py": "load_model -> DigitsCNN, eval mode: True",
    "regression_mae.py": "best val_mae",
    "pytorch_tutorial.py": "load_model -> Net; best trial test set accuracy",
}
# Why two at a time: one script leaves a core of this 2-core machine idle for
# much of its run (its driver imports ray.tune and torch on one core, its
# bucket trains on one, trial actors start one by one). Measured here, each
# way alternated with the other: the four examples took 55-66 s one after
# another and 40-52 s two at a time (4 runs each); with the quickstart, 64 and
# 80 s against 59 and 69 s (2 runs each), for 10-18 CPU-s more (two Tune
# drivers at once), which the idle core absorbs. Five at once, tried in an
# earlier stop, was slower than one after another (about 50% more CPU).
AT_ONCE = 2
QUICKSTART = "quickstart.py"


def _run(script: str, home: pathlib.Path, ray_env: dict[str, str]) -> subprocess.CompletedProcess:
    if script == QUICKSTART:  # from the repository's root, in this environment, as `make demo` runs it
        env, cwd = {**os.environ, "RAY_DEDUP_LOGS": "1", **ray_env}, ROOT
    else:  # from an empty folder, a bare environment: nothing of the repository's but the script
        env, cwd = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
                    **ray_env}, home
    return subprocess.run([sys.executable, str(EXAMPLES / script), "--fast"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def fast_runs(request, script_ray_env, tmp_path_factory) -> dict[str, Future]:
    """The run of each Ray example this session selected, started at the
    module's first test, ``AT_ONCE`` at a time; each test waits for its own."""
    selected = {item.callspec.params["script"] if hasattr(item, "callspec") else QUICKSTART
                for item in request.session.items
                if item.module is request.module and "fast_runs" in item.fixturenames}
    scripts = [s for s in (QUICKSTART, *FAST_EXAMPLES) if s in selected]  # the longest first
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        yield {s: pool.submit(_run, s, tmp_path_factory.mktemp(s.split(".")[0]), script_ray_env) for s in scripts}


@pytest.mark.parametrize("script", list(FAST_EXAMPLES))
def test_example_runs_in_fast_mode(script, fast_runs):
    done = fast_runs[script].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert FAST_EXAMPLES[script] in done.stdout
    assert re.search(r"[\s(]0 errors", done.stdout), done.stdout[-2000:]


def test_quickstart_fast_prints_best_config_accuracy_and_fusion(fast_runs):
    out = fast_runs[QUICKSTART].result()
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "6 trials in" in text and "(0 errors)" in text
    assert "best config: {" in text and "best val_accuracy: 0." in text
    fused = [line for line in text.splitlines() if "trials fused" in line and "chorus-bucket-" in line]
    assert fused and sum(int(line.rsplit(",", 1)[1].split()[0]) for line in fused) >= 6
    assert "load_model -> Sequential" in text


def test_core_demo_runs():
    done = subprocess.run([sys.executable, str(EXAMPLES / "core_demo.py")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "16 members x 10 epochs" in done.stdout
