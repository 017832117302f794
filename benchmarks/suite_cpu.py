"""Where a command's CPU goes, by kind of process: ``python benchmarks/suite_cpu.py -- make test``.

The suite is CPU-bound on a 2-core machine, and most of its CPU is spent in
processes the tests start (Ray's trial actors, buckets, pools, its own
daemons), not in the pytest that runs them. This runs a command, reads
``/proc`` every ``--poll-s`` while it runs, and prints, for each kind of
process that started during it, how many there were and the CPU-seconds they
used (user + system), with the machine's idle core-seconds over the run.

A process is told apart by what it showed as its command line while it ran:
Ray names an actor's process ``ray::<Class>`` (``ray::ChorusBucket``), an
unused worker ``ray::IDLE``, and its daemons by their programs (``raylet``,
``gcs_server``, ...). Only processes that started after the command did are
counted (so neither the kernel's threads nor a daemon already running).

Limits, each biasing the totals down: a process's CPU is its last reading,
up to ``--poll-s`` before it exited; one that lived less than ``--poll-s`` may
be missed. Linux only. The polling takes CPU of its own from what it
watches, so time a run for its wall time without it: on the 2-core machine,
the suite's Ray tests took 668 s with a /proc poller beside them and 577 s
without (the same code; stop 32), and 629-630 s under this script against
554-564 s without it on the code of a few commits later.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proc_reading import TICKS_PER_S, pids, read_cmdline, read_stat

# The actor classes the suite starts, most specific first: a title names one.
ACTOR_CLASSES = ("ChorusTrainable", "ChorusBucket", "ChorusPool")
# Ray's own programs, by a word of their command line.
RAY_DAEMONS = ("gcs_server", "raylet", "dashboard/agent.py", "dashboard/dashboard.py", "log_monitor",
               "runtime_env/agent", "autoscaler/_private/monitor.py", "ray-dashboard-")


@dataclass
class Seen:
    """One process as polled: the most CPU read for it and the titles it showed."""

    cpu_s: float = 0.0
    titles: list[str] = field(default_factory=list)


def role(titles: Iterable[str]) -> str:
    """What kind of process showed these command lines, in words."""
    titles = [t for t in titles if t]
    text = " | ".join(titles)
    for name in ACTOR_CLASSES:
        if f"ray::{name}" in text:
            return f"actor {name}"
    actor = next((t.split()[0] for t in titles if t.startswith("ray::") and not t.startswith("ray::IDLE")), None)
    if actor is not None:
        return f"actor or task {actor.split('.')[0][5:]}"
    if any(t.startswith("ray::IDLE") for t in titles):
        return "Ray worker, never used"
    for daemon in RAY_DAEMONS:
        if daemon in text:
            return f"Ray daemon {daemon.rsplit('/', 1)[-1].removesuffix('.py').rstrip('-')}"
    if any("pytest" in map(os.path.basename, t.split()[:3]) for t in titles):
        return "pytest"  # `python -m pytest` or a pytest script; not a script under /tmp/pytest-of-*
    if not titles:
        return "unnamed"
    words = titles[0].split()
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    if script is not None:
        return f"script {os.path.basename(script)}"
    return f"program {os.path.basename(words[0])}"


def summarise(seen: dict[str, Seen]) -> list[tuple[str, int, float]]:
    """``(kind, processes, CPU seconds)`` per kind, the most CPU first."""
    cpu, count = Counter(), Counter()
    for process in seen.values():
        kind = role(process.titles)
        cpu[kind] += process.cpu_s
        count[kind] += 1
    return sorted(((kind, count[kind], cpu[kind]) for kind in cpu), key=lambda row: -row[2])


def _machine_idle() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[3] + values[4], sum(values)  # idle + iowait, all


def _boot_ticks_now(ticks_per_s: float) -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * ticks_per_s)


def poll(command: Sequence[str], poll_s: float) -> tuple[int, float, dict[str, Seen], float]:
    """Run ``command``, polling ``/proc`` until it exits: ``(exit code, wall
    seconds, processes seen, idle share of the machine's CPU)``."""
    began = _boot_ticks_now(TICKS_PER_S) - 1
    idle0, all0 = _machine_idle()
    start = time.monotonic()
    child = subprocess.Popen(list(command))
    seen: dict[str, Seen] = {}
    while True:
        done = child.poll() is not None
        for pid in pids():
            stat = read_stat(pid)
            if stat is None or stat.started < began or pid == os.getpid():
                continue  # gone meanwhile, or not the command's
            title = read_cmdline(pid, limit=200)
            process = seen.setdefault(f"{pid}:{stat.started}", Seen())
            process.cpu_s = max(process.cpu_s, stat.cpu_s)
            if title and title not in process.titles and len(process.titles) < 8:
                process.titles.append(title)
        if done:
            break
        time.sleep(poll_s)
    idle1, all1 = _machine_idle()
    return child.returncode, time.monotonic() - start, seen, (idle1 - idle0) / max(1, all1 - all0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--poll-s S] [--json FILE] -- COMMAND ...")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between two readings of /proc")
    parser.add_argument("--json", help="also write every process seen (CPU, titles) here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --, e.g. `-- make test`")
    code, wall_s, seen, idle = poll(command, args.poll_s)
    rows = summarise(seen)
    total = sum(cpu for _, _, cpu in rows)
    cores = os.cpu_count() or 1
    print(f"\n{' '.join(command)}: exit {code}, {wall_s:.0f} s wall, {total:.0f} CPU-s in {len(seen)} processes "
          f"that started during it; the machine was {idle:.0%} idle ({idle * cores * wall_s:.0f} core-s of "
          f"{cores * wall_s:.0f})")
    print(f"{'CPU-s':>8} {'procs':>6} {'each':>6}  kind")
    for kind, count, cpu in rows:
        print(f"{cpu:8.1f} {count:6d} {cpu / count:6.2f}  {kind}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({key: {"cpu_s": p.cpu_s, "titles": p.titles} for key, p in seen.items()}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
