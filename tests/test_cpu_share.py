"""benchmarks/cpu_share.py: each process's CPU time counted once, under the role its command line names."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import cpu_share  # noqa: E402  (benchmarks/ is not a package)


@pytest.mark.parametrize("cmdline, role", [
    ("ray::ChorusBucket.next_results", "buckets"),
    ("ray::ChorusBucket", "buckets"),
    ("ray::ChorusPool.seat", "pool"),
    ("ray::IDLE", "idle workers"),
    ("ray::ImplicitFunc.train", "trial actors"),
    ("ray::ChorusTrainable.train", "trial actors"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --port=0", "Ray daemons"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node", "Ray daemons"),
    ("ray::DashboardAgent", "Ray daemons"),
])
def test_a_process_is_counted_under_the_role_its_command_line_names(cmdline, role):
    assert cpu_share.role_of(cmdline, driver=False) == role


def test_the_invocations_own_process_is_the_driver_whatever_its_command_line():
    assert cpu_share.role_of("ray::ChorusBucket", driver=True) == "driver"


def test_a_childs_cpu_time_counts_beside_the_drivers():
    # The child burns about 0.6 s of CPU; the driver waits for it without
    # burning any: a sampler that watched the driver alone would see ~0.
    child = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    command = [sys.executable, "-c",
               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"]
    cpu, wall, _ = cpu_share.sample_run(command, interval=0.05)
    assert sum(cpu.values()) - cpu["driver"] >= 0.4
    assert wall >= 0.6


def test_a_run_that_fails_says_so_with_its_output():
    with pytest.raises(RuntimeError, match="boom"):
        cpu_share.sample_run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], interval=0.05)
