"""How soon a fresh job's first result comes, with the pool started early and without.

A ChorusTrainable starts its job's pool in the driver as Tune creates the
trials (``default_resource_request``), so that the pool's start (a Ray worker
and torch's import) overlaps the trial actors' own; before, the first trial's
``setup`` started it, after that trial actor had started. Each run is a fresh
Python process and a fresh local Ray (``--cpus``), a sweep of ``--trials``
width-64 digits MLPs under Tune's default search and a stop dict of 2
iterations, written the Tune way; ``off`` turns the early start off. The two
alternate, ``--repeats`` runs each; reported: seconds from ``fit()`` to the
first result and to the end of ``fit()``, their medians, and off / on.

    .venv/bin/python benchmarks/first_result.py [--repeats 3] [--trials 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(early: bool, trials: int, cpus: int) -> dict:
    """In this process (a fresh one): seconds from ``fit()`` to the first result and to its end."""
    import ray
    from ray import tune
    from torch import nn

    import chorus_tune.tune.trial.trainable as trainable_module
    from chorus_tune import Task
    from chorus_tune.examples_data import digits_split
    from chorus_tune.tune import ChorusTrainable

    if not early:
        trainable_module._start_pool_early = lambda: None  # the pool starts in the first trial's setup
    ray.init(num_cpus=cpus, include_dashboard=False, configure_logging=False)

    def mlp(config: dict) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    class FirstResult(tune.Callback):
        at = None

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if self.at is None:
                self.at = time.perf_counter()

    first = FirstResult()
    trainable = ChorusTrainable.for_task(Task(model=mlp, data=digits_split, batch_size=64), bucket_size=trials)
    start = time.perf_counter()
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.02 * (i + 1) for i in range(trials)])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
        run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(), stop={"training_iteration": 2}, verbose=0,
                                  callbacks=[first])).fit()
    end = time.perf_counter()
    assert not results.errors, results.errors
    ray.shutdown()
    return {"first_result_s": first.at - start, "fit_s": end - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)  # a child's own run
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one == "on", args.trials, args.cpus)), flush=True)
        return
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):  # alternating: drifting load hits both alike
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mode, "--trials",
                                   str(args.trials), "--cpus", str(args.cpus)],
                                  capture_output=True, text=True, cwd=ROOT)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                sys.exit(f"a {mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            runs[mode].append(json.loads(line[len("RESULT "):]))
            print(mode, {k: round(v, 2) for k, v in runs[mode][-1].items()}, flush=True)
    medians = {mode: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for mode, rows in runs.items()}
    ratio = {k: medians["off"][k] / medians["on"][k] for k in medians["on"]}
    print("medians:", {mode: {k: round(v, 2) for k, v in m.items()} for mode, m in medians.items()})
    print("off / on:", {k: round(v, 2) for k, v in ratio.items()})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"python": platform.python_version(), "cpus": args.cpus, "trials": args.trials,
                       "repeats": args.repeats, "runs": runs, "medians": medians, "off_over_on": ratio}, fh, indent=2)


if __name__ == "__main__":
    main()
