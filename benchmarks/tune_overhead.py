"""Tune's own cost per result, and what a user can turn off.

Every result a trial reports goes through Tune's driver, one at a time: the
scheduler, the searcher, the callbacks (loggers, progress), the experiment
state. With trials that report fast (fused members whose results are already
computed), that cost is what a sweep waits for. This measures it with a
function trainable that does nothing but report, so nothing else is timed:

    .venv/bin/python benchmarks/tune_overhead.py --json benchmarks/results/tune_overhead.json

Each setting runs in a fresh process (Tune reads its environment once), as two
sweeps of the same trials, one reporting ``--few`` and one ``--many`` results
per trial; the difference in wall time over the difference in results is the
cost of one result, start-up and teardown cancelled out. Settings:

- ``default``: Tune as installed (CSV, JSON and TensorBoard loggers).
- ``no-tensorboard``: ``TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=1`` with the CSV
  and JSON loggers passed back in (``ResultGrid`` and ``Tuner.restore`` need
  them; TensorBoard files are what is given up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "default": {},
    "no-tensorboard": {"TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"},
}


def one_sweep(trials: int, results: int, loggers: bool) -> float:
    """Wall seconds of one Tuner.fit of ``trials`` trials reporting ``results`` each."""
    import tempfile

    from ray import tune

    def report_only(config):
        for i in range(config["results"]):
            tune.report({"score": float(i)})

    callbacks = []
    if loggers:
        from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

        callbacks = [CSVLoggerCallback(), JsonLoggerCallback()]
    with tempfile.TemporaryDirectory() as storage:
        start = time.perf_counter()
        tune.Tuner(report_only, param_space={"results": results, "i": tune.grid_search(list(range(trials)))},
                   tune_config=tune.TuneConfig(metric="score", mode="max", reuse_actors=True),
                   run_config=tune.RunConfig(storage_path=storage, verbose=0, callbacks=callbacks)).fit()
        return time.perf_counter() - start


def child(args) -> None:
    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    loggers = os.environ.get("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS") == "1"
    out = {"few": [], "many": []}
    for _ in range(args.repeats):
        out["few"].append(one_sweep(args.trials, args.few, loggers))
        out["many"].append(one_sweep(args.trials, args.many, loggers))
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--few", type=int, default=10)
    parser.add_argument("--many", type=int, default=210)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = {}
    extra = (args.many - args.few) * args.trials
    for name, env in SETTINGS.items():
        done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True,
                              text=True, env={**os.environ, **env}, check=True)
        walls = json.loads(done.stdout.strip().splitlines()[-1])
        per_result = [(m - f) / extra for f, m in zip(walls["few"], walls["many"])]
        rows[name] = {"ms_per_result": 1e3 * statistics.median(per_result),
                      "ms_per_result_runs": [1e3 * p for p in per_result], "walls": walls}
        print(f"{name:15} {rows[name]['ms_per_result']:6.2f} ms per result "
              f"(runs: {', '.join(f'{1e3 * p:.2f}' for p in per_result)})", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
