"""The GPU check's pieces that run without Ray or a GPU, fast (issue 10).

The whole script runs on a CPU at toy sizes with
``SMOKE=1 PY=.venv/bin/python OUT=/tmp/gpu-smoke bash benchmarks/gpu_check.sh``
(about 10 minutes on 2 cores: too long for the suite). Here: the workloads'
data and models, plain Tune's resource request, the fused-step variants and the
summary, the script's syntax, and that docs/development.md gives the script's own device
commands. No timing is asserted.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import workloads  # noqa: E402


@pytest.mark.parametrize("name, shape", [("cifar-cnn3", (3, 32, 32)), ("tab-mlp2", (64,))])
def test_sized_workloads_make_the_same_data_every_time(name, shape):
    model, data = workloads.workload(name, n_train=96, n_val=32)
    (x, y), (xv, yv) = data()
    assert x.shape == (96, *shape) and xv.shape == (32, *shape) and x.dtype == torch.float32
    assert y.shape == (96,) and yv.shape == (32,) and 0 <= int(y.min()) and int(y.max()) < 10
    (x2, y2), _ = data()
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # The sizes are in the qualified name, which is part of a bucket's structural key.
    assert data.__qualname__.endswith("_96_32")
    for width in (4, 8):
        assert model({"width": width})(x[:5]).shape == (5, 10)


def test_the_default_sizes_are_cifars_and_fixed_workloads_refuse_sizes():
    _, data = workloads.WORKLOADS["cifar-cnn3"]
    assert data.__qualname__ == "cifar_gratings_50000_10000"
    with pytest.raises(ValueError, match="fixed size"):
        workloads.workload("digits-mlp64", n_train=10)


def test_the_process_cache_outlives_the_module_copies_ray_unpickles():
    cache = workloads.process_cache()
    cache["probe"] = 1
    assert workloads.process_cache() is cache and sys.modules["_chorus_bench_cache"].data["probe"] == 1
    del cache["probe"]


def test_plain_tune_asks_for_a_card_share_on_cuda_and_a_core_share_on_a_cpu(monkeypatch):
    import vs_tune

    monkeypatch.setattr(vs_tune.os, "cpu_count", lambda: 16)
    assert vs_tune.plain_resources(SimpleNamespace(device="cuda", gpu_fraction=0.125)) == {"cpu": 1, "gpu": 0.125}
    assert vs_tune.plain_resources(SimpleNamespace(device="cpu", gpu_fraction=0.125)) == {"cpu": 2.0}
    assert vs_tune.plain_resources(SimpleNamespace(device="cpu", gpu_fraction=None)) == {"cpu": 1}
    assert vs_tune.plain_resources(SimpleNamespace(device="cuda", gpu_fraction=None)) == {"cpu": 1, "gpu": 1 / 16}


def test_fused_step_variants_side_by_side_and_the_summary(tmp_path):
    out = tmp_path / "fused_step.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fused_step.py"), "--device", "cpu", "--models", "mlp64", "--ks", "2",
         "--steps", "2", "--repeats", "1", "--variants", "fp32,bf16,fp32:eager", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["torch"] == torch.__version__ and report["variants"] == ["fp32", "bf16", "fp32:eager"]
    (row,) = report["rows"]
    assert set(row["variants"]) == {"fp32", "bf16", "fp32:eager"} and set(row["eager_by_precision"]) == {"fp32", "bf16"}
    assert row["variants"]["fp32:eager"]["route"] == "eager" and row["variants"]["fp32"]["first_over_this"] == 1.0
    summary = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_summary.py"), str(tmp_path)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert summary.returncode == 0 and "mlp64 K=2: eager/fused fp32" in summary.stdout, summary.stdout


def test_fused_step_times_torch_s_cross_entropy_against_its_vmap_form_side_by_side(tmp_path):
    out = tmp_path / "loss_form.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fused_step.py"), "--loss-form", "--device", "cpu", "--models", "mlp64",
         "--ks", "2", "--steps", "2", "--repeats", "1", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["loss_form"]
    assert (row["model"], row["k"]) == ("mlp64", 2)
    assert row["ratio"] == pytest.approx(row["torch_ms_per_step"] / row["vmap_form_ms_per_step"])


def test_gpu_summary_reads_a_vs_tune_and_a_share_card_report(tmp_path):
    env = {"device": "cuda", "device_name": "card", "driver": "1.0", "torch": "t", "torch_cuda": "c"}
    row = {"workload": "cifar-cnn3", "trials": 64, "scheduler": "fifo", "epochs": 2,
           "median_wall_s": {"plain@0.25": 40.0, "plain@0.125": 30.0, "chorus": 10.0},
           "best": {"plain@0.25": 0.9, "plain@0.125": 0.9, "chorus": 0.905},
           "budget_hit": {"plain@0.25": True, "plain@0.125": True, "chorus": False}, "plain_way": "plain@0.125",
           "plain_over_chorus": 3.0, "plain_over_chorus_per_member_epoch": 2.5, "best_plain_minus_chorus": -0.005,
           "best_gap_caveat": "a side hit its time budget",
           "member_epochs": {"plain@0.25": 100, "plain@0.125": 128, "chorus": 160}}
    cut = {"workload": "tab-mlp2", "trials": 64, "scheduler": "asha", "epochs": 4}  # no timed run finished
    (tmp_path / "vs_tune-cnn.json").write_text(json.dumps({**env, "complete": False, "rows": [row, cut]}))
    runs = [{"gpu_per_bucket": s, "wall_s": w, "best": 0.9, "budget_hit": False} for s, w in ((1.0, 20.0), (0.5, 10.0))]
    (tmp_path / "share_card.json").write_text(json.dumps(
        {**env, "trials": 48, "complete": True, "median_wall_s": {"1.0": 20.0, "0.5": 10.0},
         "first_over_share": {"1.0": 1.0, "0.5": 2.0}, "runs": runs}))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0
    assert "[INCOMPLETE]" in done.stdout and "plain@0.125 30.0 s+" in done.stdout, done.stdout
    assert "(a)/(b) 3.00x [(a) = plain@0.125], per member-epoch 2.50x" in done.stdout, done.stdout
    assert "(a side hit its time budget)" in done.stdout and "member-epochs plain@0.25 100" in done.stdout
    assert "unreadable" not in done.stdout, done.stdout
    assert "GPU/bucket   0.5:   10.0 s  1-per-card/this 2.00x" in done.stdout, done.stdout


def test_the_script_parses_and_the_development_guide_gives_its_device_commands():
    script = (BENCHMARKS / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")]).returncode == 0
    call2 = ("bash .gpu-b/ray-wheels.sh unpack /tmp/gpu-a .gpu-b /tmp/site && export PYTHONPATH=/tmp/site:. "
             "&& ARCHIVE=$OUT/gpu_check.tgz OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh")
    call1 = "rm -rf /tmp/gpu-a && cp -r .gpu-a /tmp/gpu-a"
    guide = (ROOT / "docs" / "development.md").read_text()
    for command in (call1, call2):
        assert command in script and command in guide


def test_the_script_runs_plain_at_three_card_shares_with_repeats_and_warm_ups_by_default():
    """Issue 22: plain Tune at 1/4, 1/8 and 1/16 of the card, 3 repeats after a warm-up, the
    compiled route against compiled eager models too; a smoke run can pick its parts.
    Issue 43: a 128-trial ASHA part and a width-sweep part."""
    script = (BENCHMARKS / "gpu_check.sh").read_text()
    full = script.split("else", 1)[1]  # the settings after the smoke branch
    assert "FRACTIONS=${FRACTIONS:-0.25,0.125,0.0625}" in full and "REPEATS=${REPEATS:-3}" in full
    assert "WARMUP=${WARMUP:-1}" in script and "PARTS=${PARTS:-cnn,mlp,asha128,widths,share,step,compiled}" in script
    # Issue 43: ASHA at 128 trials and the width sweep, on data made on the card (no sklearn there).
    assert "--trials $TRIALS_ASHA" in script and "TRIALS_ASHA=128" in full and "--workload tab-widths" in script
    assert "--gpu-fraction $FRACTIONS" in script and "--repeats $REPEATS --warmup $WARMUP" in script
    assert "--compiled-eager" in script and "--max-iterations" not in script
    share = (BENCHMARKS / "share_card.py").read_text()
    assert "max_iterations=" not in share and "vs_tune.settle(" in share
