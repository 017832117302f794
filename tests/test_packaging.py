"""What ``pip install chorus_tune`` gives works without the dev extras.

The wheel is built from a copy of the package (the working tree is left alone),
installed with ``--target`` into a temporary folder, and imported from outside
the repository with this interpreter's torch and ray, scikit-learn made
unimportable: the README's quickstart imports and ``digits_split()`` must work.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import torch

from chorus_tune.examples_data import digits_arrays, digits_split

REPO = Path(__file__).resolve().parents[1]
OFFLINE_PIP = ["--no-deps", "--no-index", "--disable-pip-version-check", "-q"]


def test_shipped_digits_equal_scikit_learns():
    import pytest

    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    data, target = digits_arrays()
    assert data.dtype == digits.data.dtype and target.dtype == digits.target.dtype
    np.testing.assert_array_equal(data, digits.data)
    np.testing.assert_array_equal(target, digits.target)
    # digits_split() is what it was when it read scikit-learn's copy.
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    (xt, yt), (xv, yv) = digits_split()
    for got, want in ((xt, x[:1400]), (yt, y[:1400]), (xv, x[1400:]), (yv, y[1400:])):
        assert got.dtype == want.dtype and torch.equal(got, want)
    (xt, _), (xv, _) = digits_split(n_train=1000)
    assert xt.shape == (1000, 64) and xv.shape == (797, 64)


INSTALLED_CHECK = textwrap.dedent("""
    import sys
    site = sys.argv[1]
    import chorus_tune
    assert chorus_tune.__file__.startswith(site), f"chorus_tune came from {chorus_tune.__file__}, not the wheel"
    try:
        import sklearn  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("scikit-learn is importable: the check would prove nothing")

    # The README's quickstart imports.
    from ray import tune  # noqa: F401
    from torch import nn
    from chorus_tune import ChorusASHA, ChorusSearch, ChorusTrainable, Task  # noqa: F401
    from chorus_tune.examples_data import digits_split
    import chorus_tune.tune.trial.trainable as trainable_module
    assert trainable_module.__file__.startswith(site), trainable_module.__file__

    (x, y), (xv, yv) = digits_split()
    assert tuple(x.shape) == (1400, 64) and tuple(xv.shape) == (397, 64)
    assert 0.0 <= float(x.min()) and float(x.max()) == 1.0 and sorted(set(y.tolist())) == list(range(10))

    # The core trains on it.
    import chorus_tune as ct

    def mlp(config):
        return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    bucket = ct.Bucket(ct.Task(mlp, digits_split, iteration_steps=2), capacity=2, route="eager")
    bucket.add(dict(lr=0.1, seed=0))
    result = bucket.run_iteration()
    assert result[0]["iteration"] == 1, result
    assert not any(name == "sklearn" or name.startswith("sklearn.") for name in sys.modules if sys.modules[name])
    print("installed wheel ok")
""")


def _copy_sources(into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, into / name)
    shutil.copytree(REPO / "chorus_tune", into / "chorus_tune", ignore=ignore)


def test_wheel_installs_and_runs_the_quickstart_without_scikit_learn(tmp_path):
    src, dist, site, shim = (tmp_path / n for n in ("src", "dist", "site", "shim"))
    src.mkdir()
    _copy_sources(src)  # the build writes build/ and *.egg-info: never into the working tree
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "pip", "wheel", *OFFLINE_PIP, "--no-build-isolation",
                    "--wheel-dir", str(dist), str(src)], check=True, env=env, cwd=tmp_path, timeout=120)
    (wheel,) = dist.glob("chorus_tune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "chorus_tune/data_files/digits.npz" in names
    assert {"chorus_tune/examples_data.py", "chorus_tune/tune/trial/trainable.py"} <= names
    assert not any(n.startswith("tests/") for n in names)

    subprocess.run([sys.executable, "-m", "pip", "install", *OFFLINE_PIP, "--target", str(site), str(wheel)],
                   check=True, env=env, cwd=tmp_path, timeout=120)
    (shim / "sklearn").mkdir(parents=True)
    (shim / "sklearn" / "__init__.py").write_text(
        'raise ImportError("scikit-learn is not installed (made unimportable by tests/test_packaging.py)")\n')

    run_env = {**env, "PYTHONPATH": os.pathsep.join([str(shim), str(site)]), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([sys.executable, "-c", INSTALLED_CHECK, str(site)], env=run_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installed wheel ok" in done.stdout
