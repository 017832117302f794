"""A Tune driver that a test starts in its own process and kills mid-run
(tests/test_tune_recovery.py): ``python tune_restore_driver.py <ray address> <storage path>``."""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import ray
from ray import tune
from ray.tune import Callback

from chorus_tune.tune import ChorusTrainable

from tune_support import digits_task


def make_trainable():
    return ChorusTrainable.for_task(digits_task(), bucket_size=4)


def _state_settled(experiment_dir: str, trials: int, quiet_s: float = 0.5) -> bool:
    """Whether the experiment state Tune synced to ``experiment_dir`` lists
    ``trials`` trials, parses whole, and has not changed for ``quiet_s``."""
    for path in glob.glob(os.path.join(experiment_dir, "experiment_state-*.json")):
        try:
            if time.time() - os.path.getmtime(path) < quiet_s:
                continue
            with open(path) as f:
                if len(json.load(f)["trial_data"]) == trials:
                    return True
        except (OSError, ValueError, KeyError):
            continue  # being written
    return False


class _Slow(Callback):
    """Slows the run so that it can be stopped mid-way, and says when: after
    six results, once the experiment state written after the last step has
    settled in the storage path (a kill mid-write would leave an empty state
    file; a fixed 2 s wait was not always enough in a full suite run: the
    restore then found 1 trial of 3, "Failed to restore the run state")."""

    results = 0

    def __init__(self, experiment_dir: str = ""):
        self.experiment_dir = experiment_dir

    def on_trial_result(self, iteration, trials, trial, result, **info):
        # Tuner.restore brings this callback back in the test's own driver: inert there.
        if os.environ.get("CHORUS_TEST_DRIVER") != "1":
            return
        self.results += 1
        if self.results == 6:
            deadline = time.monotonic() + 30
            while not _state_settled(self.experiment_dir, len(trials)) and time.monotonic() < deadline:
                time.sleep(0.1)
            print("KILL ME", flush=True)
            time.sleep(60)
        time.sleep(0.2)


def main(address: str, storage: str) -> None:
    ray.init(address=address, configure_logging=False)
    print(f"JOB {ray.get_runtime_context().get_job_id()}", flush=True)
    tuner = tune.Tuner(
        make_trainable(), param_space={"lr": tune.grid_search([0.05, 0.1, 0.2]), "seed": 4},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
        run_config=tune.RunConfig(name="restore_me", storage_path=storage, verbose=0,
                                  stop={"training_iteration": 6},
                                  callbacks=[_Slow(os.path.join(storage, "restore_me"))],
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1)))
    tuner.fit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
