"""benchmarks/suite_cpu.py: which kind of process a command line names, and a
real run's accounting. Ray-free; no timing is asserted, only that CPU is found
where it was spent."""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import suite_cpu  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/stat").exists(), reason="reads Linux's /proc")


@pytest.mark.parametrize("titles, kind", [
    (["/venv/bin/python -u .../default_worker.py", "ray::IDLE", "ray::ChorusBucket.train"], "actor ChorusBucket"),
    (["ray::ChorusTrainable.train()", "ray::IDLE"], "actor ChorusTrainable"),
    (["ray::IDLE", "ray::create_pools"], "actor or task create_pools"),
    (["/venv/bin/python .../default_worker.py", "ray::IDLE"], "Ray worker, never used"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x"],
     "Ray daemon raylet"),
    (["/venv/bin/python /venv/lib/python3.11/site-packages/ray/dashboard/agent.py --x"], "Ray daemon agent"),
    (["/venv/bin/python -m pytest -q -m ray"], "pytest"),
    (["/venv/bin/python /repo/examples/pbt.py --fast"], "script pbt.py"),
    (["/usr/bin/chromium --headless=new"], "program chromium"),
    ([], "unnamed"),
])
def test_a_process_is_named_by_the_titles_it_showed(titles, kind):
    assert suite_cpu.role(titles) == kind


def test_the_summary_adds_up_each_kind_and_puts_the_most_cpu_first():
    seen = {"1:1": suite_cpu.Seen(2.0, ["ray::ChorusTrainable"]), "2:1": suite_cpu.Seen(2.5, ["ray::ChorusTrainable"]),
            "3:1": suite_cpu.Seen(3.5, ["ray::ChorusBucket"])}
    assert suite_cpu.summarise(seen) == [("actor ChorusTrainable", 2, 4.5), ("actor ChorusBucket", 1, 3.5)]


def test_a_run_counts_the_cpu_of_the_processes_its_command_started_and_only_those(tmp_path):
    # The command starts a script that spends about a CPU-second; this pytest,
    # running before the command, is not counted.
    burner = tmp_path / "burn.py"
    burner.write_text("import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n")
    code, wall_s, seen, idle = suite_cpu.poll([sys.executable, str(burner)], poll_s=0.1)
    assert code == 0 and 0.0 <= idle <= 1.0
    rows = {kind: (count, cpu) for kind, count, cpu in suite_cpu.summarise(seen)}
    count, cpu = rows["script burn.py"]
    assert count == 1 and cpu >= 0.5  # the last reading may be up to poll_s before it ended
    # Only CPU spent during the run: no more than every core for the whole run
    # (a process that began before it, as this pytest did, is not counted).
    assert sum(cpu for _, cpu in rows.values()) <= wall_s * os.cpu_count() + 0.1
    assert "pytest" not in rows


def test_without_a_command_it_says_how_to_give_one(capsys):
    with pytest.raises(SystemExit):
        suite_cpu.main([])
    assert "no command: give it after --" in capsys.readouterr().err
