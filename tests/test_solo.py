"""Solo members (chorus_tune.tune.rules.solo, trial/solo_run.py): who trains in its trial's
own process, and that such a member trains exactly as the reference and as a bucket would."""
from __future__ import annotations

import sys

import pytest
import ray.cloudpickle as cloudpickle

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chorus_tune import Bucket, reference  # noqa: E402
from chorus_tune.tune.rules.grouping import GroupKey  # noqa: E402
from chorus_tune.tune.rules.solo import is_solo_key, lone_members, may_train_solo, solo_key  # noqa: E402
from chorus_tune.tune.trial.solo_run import SoloRun  # noqa: E402
from chorus_tune.tune.values import result_keys as rk  # noqa: E402
from chorus_tune.tune.values import state_io  # noqa: E402
from chorus_tune.tune.values.options import BucketOptions  # noqa: E402
from chorus_tune.tune.values.plan import Plan  # noqa: E402

from models import mlp_task  # noqa: E402

CONFIG = {"lr": 0.05, "momentum": 0.5, "seed": 3}


def _key(name: str) -> GroupKey:
    return GroupKey("task", BucketOptions(), "MLP", (name,))


# ----- who trains solo ---------------------------------------------------------------------------
def test_a_member_alone_in_its_seating_with_nothing_of_its_key_in_the_pool_is_lone():
    seating = [("a", _key("x")), ("b", _key("y")), ("c", _key("y"))]
    assert lone_members(seating, in_pool=lambda key: False) == {"a"}


def test_a_member_whose_key_is_in_the_pool_already_is_not_lone():
    assert lone_members([("a", _key("x"))], in_pool=lambda key: key == _key("x")) == set()


def test_members_train_solo_only_where_buckets_share_a_cpu_machines_cores():
    assert may_train_solo({"CPU": 2}, BucketOptions())
    assert not may_train_solo({"CPU": 2, "GPU": 1}, BucketOptions())
    assert not may_train_solo({"CPU": 2}, BucketOptions(resources_per_bucket=(("CPU", 2.0),)))
    assert not may_train_solo({"CPU": 2}, BucketOptions(solo=False))


def test_a_solo_members_key_is_its_own():
    a, b = solo_key(_key("x"), "a"), solo_key(_key("x"), "b")
    assert a != b and a != _key("x") and is_solo_key(a) and not is_solo_key(_key("x"))
    assert a.options == _key("x").options  # the run's options still read off it


# ----- how a solo member trains ------------------------------------------------------------------
def _solo(task, state=None, plan=None, config=CONFIG):
    blob = cloudpickle.dumps(task)
    return SoloRun(blob, "t", "m", "place-1", dict(config), 3, state=state, plan=plan)


def test_a_solo_member_trains_as_the_reference_does():
    task = mlp_task()
    run = _solo(task)
    got = [run.step() for _ in range(3)]
    history, _ = reference.train(task, dict(CONFIG), 3, 3)
    assert [r["val_loss"] for r in got] == pytest.approx([h["val_loss"] for h in history], rel=1e-5, abs=1e-6)
    assert [r[rk.ITERATION] for r in got] == [1, 2, 3]
    assert all(r[rk.SOLO] and r[rk.LIVE] == 1 and r[rk.BUCKET] == "place-1" and r[rk.SEED] == 3 for r in got)


def test_a_solo_member_outside_ray_starts_no_ray_node_to_look_for_a_pool():
    import ray

    if ray.is_initialized():  # a whole-suite pytest may run it after a module left its Ray up
        pytest.skip("a Ray node runs in this process already: nothing to show")
    _solo(mlp_task()).step()
    assert not ray.is_initialized()


def test_a_solo_members_state_continues_in_a_bucket_as_it_would_have_solo():
    task = mlp_task()
    run = _solo(task)
    run.step()
    state = run.state()
    expected = run.step()
    bucket = Bucket(task, 4, route="eager")
    slot = bucket.restore(state_io.loads(state), dict(CONFIG))
    got = bucket.run_iteration([slot])[slot]
    assert got["iteration"] == expected[rk.ITERATION] == 2
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)


def test_a_buckets_member_state_continues_solo_as_it_would_have_in_the_bucket():
    task = mlp_task()
    bucket = Bucket(task, 2, route="eager")
    slot = bucket.add(dict(CONFIG), 3)
    bucket.run_iteration([slot])
    state = state_io.dumps(bucket.member_state(slot))
    expected = bucket.run_iteration([slot])[slot]
    got = _solo(task, state=state).step()
    assert got[rk.ITERATION] == 2
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)


def test_a_solo_members_last_result_is_done_at_its_plans_budget():
    run = _solo(mlp_task(), plan=Plan(budget=2, bucket_decides=True))
    assert [bool(run.step().get("done")) for _ in range(2)] == [False, True]


def test_a_solo_members_result_that_meets_a_stop_criterion_is_done():
    run = _solo(mlp_task(), plan=Plan(stop_criteria=(("val_accuracy", 0.0),)))
    assert run.step().get("done") is True


# ----- whose data the sweep's processes share (rules/shared_data.py) ------------------------------
def test_a_callables_data_of_cpu_tensors_is_shared():
    from chorus_tune.tune.rules.shared_data import may_share

    loaded = mlp_task().load_data()
    assert may_share(lambda: None, loaded)


def test_data_given_as_tensors_is_not_shared_again_it_travels_in_the_task():
    from chorus_tune.tune.rules.shared_data import may_share

    assert not may_share(("x", "y"), mlp_task().load_data())


def test_data_made_on_another_device_or_as_a_dataset_stays_in_its_process():
    import torch
    from torch.utils.data import Dataset

    from chorus_tune.task import TensorSplit
    from chorus_tune.tune.rules.shared_data import may_share

    on_device = TensorSplit((torch.zeros(2, 3, device="meta"), torch.zeros(2, device="meta")))
    train, val = mlp_task().load_data()
    assert not may_share(lambda: None, (on_device, val))
    assert not may_share(lambda: None, (train, Dataset()))


def test_the_pool_loads_a_tasks_data_ahead_only_on_a_cluster_without_gpus():
    from chorus_tune.tune.rules.shared_data import pool_preloads

    assert pool_preloads({"CPU": 2}) and not pool_preloads({"CPU": 16, "GPU": 1})
