"""Where a sweep's CPU goes: CPU-seconds per process role, plain Tune beside chorus_tune.

On a machine of few cores a sweep is bound by CPU, not by the fused step alone:
the driver (Tune's loop and loggers), the trial actors, chorus_tune's pool and
buckets and Ray's own daemons all share the cores. A wall-time ratio says how
long; this says who spent the cores. For each way (``plain``, ``chorus``), one
``benchmarks/vs_tune.py`` invocation of that way alone (``--repeats 1
--warmup 0``), ways alternated, ``--repeats`` times. Meanwhile every process
under the invocation's driver (Ray's daemons and workers are its descendants)
is sampled from ``/proc`` every ``--interval`` seconds; each process's CPU time
(user + system) is its last sample's, under the role its last command line
names (a Ray worker that starts as ``ray::IDLE`` and becomes a trial actor
counts wholly as a trial actor: its start-up is the trial's).

Roles: ``driver`` (the vs_tune process: imports, the sweep's data, Tune's loop),
``trial actors`` (every other actor a Tune trial runs in), ``pool`` and
``buckets`` (chorus_tune's), ``idle workers`` (Ray workers never given a task),
``Ray daemons`` (GCS, raylet, dashboard and agents), ``other`` (anything else).

Caveats: a process that exits loses up to one interval of CPU time (sampling;
stated in the output); the invocation's wall time includes Ray's start and
shutdown, the sweep's own is vs_tune's (``fit()`` to its end); and the sampler
itself (this process, not counted) reads every ``/proc/<pid>/stat`` each
interval, on the same cores as the sweep.

    .venv/bin/python benchmarks/cpu_share.py --repeats 1 -- --workload synth-mlp64 --trials 128 --rows asha:16:16
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from proc_reading import ProcStat, pids, read_cmdline, read_stat

ROLES = ("driver", "trial actors", "pool", "buckets", "idle workers", "Ray daemons", "other")
_DAEMONS = ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "DashboardAgent", "RuntimeEnvAgent",
            "runtime_env", "agent")
_WALL = re.compile(r"repeat 1 \w+\s+([0-9.]+) s")
_EPOCHS = re.compile(r"repeat 1 \w+\s.*member-epochs ([0-9]+)")
# Where each way trains: plain Tune in its trial actors, chorus_tune in its buckets.
TRAINS_IN = {"plain": "trial actors", "chorus": "buckets"}


def role_of(cmdline: str, driver: bool) -> str:
    """The role of a process by its command line (Ray sets a worker's to ``ray::<Actor>``)."""
    if driver:
        return "driver"
    if "ray::ChorusBucket" in cmdline:
        return "buckets"
    if "ray::ChorusPool" in cmdline:
        return "pool"
    if "ray::IDLE" in cmdline:
        return "idle workers"
    if any(name in cmdline for name in _DAEMONS):
        return "Ray daemons"
    if cmdline.startswith("ray::"):
        return "trial actors"
    return "other"


def _descendants(root: int, stats: dict[int, ProcStat]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        children.setdefault(stat.parent, []).append(pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def sample_run(command: list[str], interval: float) -> tuple[dict[str, float], float, str]:
    """Run ``command``; CPU seconds per role over its process tree, its wall time, its output."""
    last: dict[int, tuple[str, float]] = {}
    with tempfile.TemporaryFile("w+") as out:
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        while True:
            stats = {pid: stat for pid in pids() if (stat := read_stat(pid)) is not None}
            for pid in _descendants(proc.pid, stats):
                line = read_cmdline(pid)
                role = role_of(line, pid == proc.pid) if line else last.get(pid, ("other", 0.0))[0]
                last[pid] = (role, stats[pid].cpu_s)
            if proc.poll() is not None:
                break
            time.sleep(interval)
        wall = time.monotonic() - start
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{text[-3000:]}")
    cpu = dict.fromkeys(ROLES, 0.0)
    for role, seconds in last.values():
        cpu[role] += seconds
    return cpu, wall, text


def summary(medians: dict, ways: list[str], repeats: int, cores: int, sweep: list[str], interval: float) -> str:
    """The Markdown table of CPU seconds per role (share of each way's total), and the wall times."""
    lines = [f"CPU seconds per role, medians of {repeats} ({cores} cores; vs_tune {' '.join(sweep)}):", "",
             "| role | " + " | ".join(ways) + " |", "|---|" + "---|" * len(ways)]
    for role in (*ROLES, "all"):
        cells = []
        for way in ways:
            cpu = medians[way]["cpu_s"]
            total = sum(cpu.values())
            value = total if role == "all" else cpu[role]
            cells.append(f"{value:.1f} ({100 * value / total:.0f}%)" if total else "-")
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    for label, key in (("sweep wall (vs_tune, fit() to the end)", "sweep_s"),
                       ("invocation wall (Ray's start and shutdown too)", "invocation_s")):
        lines.append(f"| {label} | " + " | ".join("-" if medians[w][key] is None else f"{medians[w][key]:.1f} s"
                                                  for w in ways) + " |")
    cells = []
    for way in ways:
        role, epochs = TRAINS_IN.get(way), medians[way]["member_epochs"]
        cells.append(f"{1000 * medians[way]['cpu_s'][role] / epochs:.0f} ms ({role}, {epochs:g} member-epochs)"
                     if role and epochs else "-")
    lines.append("| CPU per member-epoch where it trains (start-up included) | " + " | ".join(cells) + " |")
    lines += ["", f"A process that exits loses up to {interval} s of CPU time to the sampling."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ways", default="plain,chorus")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples of /proc")
    parser.add_argument("--json", default=None, help="write the runs and medians here")
    parser.add_argument("--md", default=None, help="write the table here")
    parser.add_argument("vs_tune_args", nargs=argparse.REMAINDER,
                        help="after --: vs_tune.py's arguments for the sweep (not --ways/--repeats/--warmup)")
    args = parser.parse_args(argv)
    sweep = [a for a in args.vs_tune_args if a != "--"]
    script = str(pathlib.Path(__file__).with_name("vs_tune.py"))
    ways = args.ways.split(",")
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = ways if repeat % 2 == 0 else ways[::-1]  # alternated: neither way always goes first
            for way in order:
                command = [sys.executable, script, *sweep, "--ways", way, "--repeats", "1", "--warmup", "0",
                           "--out", scratch]
                cpu, wall, text = sample_run(command, args.interval)
                found = _WALL.search(text)
                sweep_s = float(found.group(1)) if found else None
                epochs = _EPOCHS.search(text)
                runs[way].append({"cpu_s": cpu, "invocation_s": wall, "sweep_s": sweep_s,
                                  "member_epochs": int(epochs.group(1)) if epochs else None})
                print(f"repeat {repeat + 1} {way:7s} sweep {sweep_s} s, invocation {wall:.1f} s, CPU "
                      + ", ".join(f"{r} {s:.1f}" for r, s in cpu.items()), flush=True)
    medians = {way: {"cpu_s": {r: statistics.median(run["cpu_s"][r] for run in rs) for r in ROLES},
                     "invocation_s": statistics.median(run["invocation_s"] for run in rs),
                     **{key: statistics.median(run[key] for run in rs if run[key] is not None)
                        if any(run[key] is not None for run in rs) else None
                        for key in ("sweep_s", "member_epochs")}}
               for way, rs in runs.items()}
    cores = os.cpu_count() or 1
    table = summary(medians, ways, args.repeats, cores, sweep, args.interval)
    print("\n" + table)
    if args.md:
        pathlib.Path(args.md).write_text(table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"vs_tune_args": sweep, "cores": cores, "interval_s": args.interval, "runs": runs,
             "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
