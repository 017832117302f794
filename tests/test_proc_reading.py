"""benchmarks/proc_reading.py: a process's stat and command line, as the CPU benchmarks read them (Ray-free)."""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import proc_reading  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/stat").exists(), reason="reads Linux's /proc")


def test_stat_fields_are_counted_from_the_last_parenthesis_of_the_command_name():
    # A command name may hold spaces and parentheses: "(a) b)" here.
    line = "42 ((a) b)) S 7 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 12345 1000 10 0"
    assert proc_reading.parse_stat(line, ticks_per_s=100) == proc_reading.ProcStat(7, 3.0, 12345)


def test_this_process_reads_as_a_child_of_its_parent_with_its_own_command_line():
    stat, line = proc_reading.read_stat(os.getpid()), proc_reading.read_cmdline(os.getpid())
    assert stat is not None and stat.parent == os.getppid() and stat.cpu_s > 0
    assert "pytest" in line or sys.executable in line
    assert os.getpid() in proc_reading.pids()


def test_a_process_that_is_gone_reads_as_nothing():
    gone = max(proc_reading.pids()) + 10_000_000  # beyond any pid the kernel hands out
    assert proc_reading.read_stat(gone) is None and proc_reading.read_cmdline(gone) == ""
