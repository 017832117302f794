"""What Ray Tune charges per trial process, apart from any training.

chorus_tune fuses K trials only while K Tune trials run at once, and Tune runs
every trial in a Ray actor of its own: a fused bucket of K needs K live trial
actors, while plain Tune on an N-core CPU keeps N actors and reuses them
(``reuse_actors=True``). This measures that cost with no training at all:
``--trials`` Tune trials of a class trainable whose ``step`` returns at once,
run with ``--concurrency`` C at a time (token CPUs, ``reuse_actors=True``), for
several C. Also the CPU time one Python process spends importing ``ray`` and
``ray.tune`` (what every trial actor does before its first step).

    .venv/bin/python benchmarks/trial_startup.py --trials 32 --concurrency 2,8,16,32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def import_cpu_seconds(module: str, repeats: int = 3) -> float:
    """Best-of CPU seconds (user + system) of a fresh interpreter that imports ``module``."""
    best = float("inf")
    for _ in range(repeats):
        before = os.times()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        after = os.times()
        best = min(best, (after.children_user - before.children_user)
                   + (after.children_system - before.children_system))
    return best


def run_idle_trials(trials: int, concurrency: int, cpus: float) -> float:
    """Wall seconds of a Tune run of ``trials`` one-iteration, no-work trials, ``concurrency`` at a time."""
    from ray import tune

    class Idle(tune.Trainable):
        def step(self) -> dict:
            return {"done": True, "score": 0.0}

        def reset_config(self, new_config: dict) -> bool:
            return True

        # Class trainables checkpoint at the end by default (as ChorusTrainable's trials do).
        def save_checkpoint(self, checkpoint_dir: str) -> dict:
            return {}

        def load_checkpoint(self, checkpoint: dict) -> None:
            pass

    token = round(cpus / concurrency - 5e-5, 4)  # Ray accounts resources in units of 1e-4
    trainable = tune.with_resources(Idle, {"cpu": token})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        tune.Tuner(trainable, param_space={"i": tune.grid_search(list(range(trials)))},
                   tune_config=tune.TuneConfig(reuse_actors=True),
                   run_config=tune.RunConfig(storage_path=storage, verbose=0)).fit()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--concurrency", default="2,8,16,32", help="trials at once, comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import ray

    imports = {m: import_cpu_seconds(m) for m in ("ray", "ray.tune")}
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    cpus = ray.cluster_resources()["CPU"]
    machine = f"{platform.machine()} {os.cpu_count()} CPUs"
    print(f"{machine}, ray {ray.__version__}")
    for module, seconds in imports.items():
        print(f"  a fresh process importing {module:8}: {seconds:.2f} CPU-s")
    run_idle_trials(2, 2, cpus)  # Tune's own first-run imports, out of the timings below
    rows = []
    print(f"{args.trials} idle trials (one no-op step each), reuse_actors=True:")
    for c in (int(x) for x in args.concurrency.split(",")):
        wall = run_idle_trials(args.trials, c, cpus)
        rows.append({"concurrency": c, "wall_s": wall})
        print(f"  {c:3d} at once: {wall:6.1f} s", flush=True)
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "ray": ray.__version__, "trials": args.trials,
                       "import_cpu_s": imports, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
