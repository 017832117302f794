"""A member whose trial stopped asking gives its slot up, and its trial rejoins on the same
trajectory (docs/design.md "Faults"; issue 20: Tune's cached actors held every slot)."""
from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle

from chorus_tune import reference
from chorus_tune.tune import ChorusTrainable
from chorus_tune.tune.rules.waits import Evicted
from chorus_tune.tune.values.protocol import NAMESPACE

from tune_support import digits_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("local_ray")

CONFIG = {"lr": 0.1, "seed": 3}


def test_an_evicted_member_s_trial_rejoins_from_its_last_result_on_its_reference(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=2, run_ahead=1)(config=dict(CONFIG))
    try:
        first = [trainable.train() for _ in range(2)]
        bucket = ray.get_actor(first[-1]["chorus/bucket"], namespace=NAMESPACE)
        member = first[-1]["chorus/member"]
        # Its trial has just asked: not idle for 60 s, so it stays.
        assert ray.get(bucket.evict_idle.remote(60.0)) == []
        # Idle for 0 s or more: it gives its slot up, keeping its state at iteration 2.
        assert ray.get(bucket.evict_idle.remote(0.0)) == [member]
        with pytest.raises(Evicted):
            ray.get(bucket.next_result.remote(member))
        # The trial's next step rejoins (through the pool's queue) and goes on from iteration 2.
        rest = [trainable.train() for _ in range(2)]
    finally:
        trainable.stop()
    history, _ = reference.train(task, CONFIG, seed=CONFIG["seed"], iterations=4)
    for result in first + rest:
        assert result["iteration"] == result["training_iteration"]
        assert result["val_loss"] == pytest.approx(history[result["iteration"] - 1]["val_loss"], rel=1e-5)
    assert [r["iteration"] for r in rest] == [3, 4]
