"""Packaging promises: the core stands without Ray."""
from __future__ import annotations

import subprocess
import sys


def test_importing_chorus_tune_does_not_import_ray():
    code = "import sys, chorus_tune; chorus_tune.Bucket; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_modules_never_import_ray():
    import pathlib

    import chorus_tune

    core = pathlib.Path(chorus_tune.__file__).parent
    offenders = [p.name for p in core.glob("*.py") if "import ray" in p.read_text() or "from ray" in p.read_text()]
    assert offenders == []


def test_a_trial_actor_importing_the_trainable_does_not_load_torch():
    # Trial actors hold no tensors; torch would cost each of them ~2 s and ~150 MB.
    code = ("import sys, chorus_tune.tune.trial.trainable; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
