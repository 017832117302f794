"""UnfusedMember (chorus_tune/unfused.py): a member trained alone and unfused
trains as the reference does, and its state moves to and from a bucket's
member state exactly, for every optimizer family (one battery, as
torch.optim's tests run one battery over every optimizer)."""
from __future__ import annotations

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chorus_tune import Bucket, reference  # noqa: E402
from chorus_tune.member_state import check_member_state  # noqa: E402
from chorus_tune.unfused import UnfusedMember  # noqa: E402

from models import mlp_task, params_close  # noqa: E402

SEED = 3
# Stable settings (small steps), so float reordering stays at float noise.
CONFIGS = {
    "sgd": {"optimizer": "sgd", "lr": 0.05},
    "sgd-momentum-wd": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.5, "weight_decay": 1e-3},
    "sgd-nesterov": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.5, "nesterov": True},
    "sgd-clipped-scheduled": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.5, "max_grad_norm": 0.5,
                              "lr_schedule": "cosine", "t_max": 60},
    "adam": {"optimizer": "adam", "lr": 1e-3},
    "adamw": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.05},
}
ITERATIONS = 4


def _reference(task, config):
    history, model = reference.train(task, dict(config), SEED, ITERATIONS)
    return [h["val_loss"] for h in history], model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_unfused_member_trains_as_the_reference(name):
    task, config = mlp_task(), CONFIGS[name]
    expected, _ = _reference(task, config)
    member = UnfusedMember(task, dict(config), SEED)
    got = [member.run_iteration() for _ in range(ITERATIONS)]
    assert [r["val_loss"] for r in got] == pytest.approx(expected, rel=1e-6)
    assert all(r["route"] == "unfused" for r in got)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_member_moving_bucket_to_unfused_to_bucket_trains_as_if_never_moved(name):
    task, config = mlp_task(), CONFIGS[name]
    expected, expected_model = _reference(task, config)
    bucket = Bucket(task, 2, route="eager")
    slot = bucket.add(dict(config), SEED)
    got = [bucket.run_iteration([slot])[slot]["val_loss"]]
    member = UnfusedMember(task, None, state=bucket.member_state(slot))
    got += [member.run_iteration()["val_loss"] for _ in range(2)]
    state = member.member_state()
    check_member_state(state)
    other = Bucket(task, 3, route="eager")
    back = other.restore(state)
    got.append(other.run_iteration([back])[back]["val_loss"])
    assert got == pytest.approx(expected, rel=1e-5)
    assert params_close(other.export_model(back), expected_model, rtol=1e-5) < 1e-5


def test_an_unfused_members_state_is_the_one_its_bucket_twin_writes():
    task, config = mlp_task(), CONFIGS["sgd-momentum-wd"]
    member = UnfusedMember(task, dict(config), SEED)
    bucket = Bucket(task, 1, route="eager")
    slot = bucket.add(dict(config), SEED)
    member.run_iteration()
    bucket.run_iteration([slot])
    mine, twin = member.member_state(), bucket.member_state(slot)
    assert {k: mine[k] for k in ("config", "seed", "iteration", "step")} == \
        {k: twin[k] for k in ("config", "seed", "iteration", "step")}
    assert mine["optimizer"]["has_buffer"] == twin["optimizer"]["has_buffer"] is True
    for name, tensors in twin["optimizer"]["tensors"].items():
        torch.testing.assert_close(mine["optimizer"]["tensors"][name]["momentum_buffer"],
                                   tensors["momentum_buffer"], rtol=1e-5, atol=1e-6)
    assert torch.equal(mine["data"]["perm"], twin["data"]["perm"]) and mine["data"]["pos"] == twin["data"]["pos"]


def test_a_state_continues_under_the_config_it_is_given():
    # PBT: a cloned state under a mutated config keeps its weights, trains at the new lr.
    task = mlp_task()
    member = UnfusedMember(task, {"lr": 0.05, "momentum": 0.5}, SEED)
    member.run_iteration()
    moved = UnfusedMember(task, {"lr": 0.01, "momentum": 0.5}, state=member.member_state())
    assert moved.config["lr"] == 0.01 and moved.seed == SEED
    assert moved.member_state()["iteration"] == 1


def test_a_state_of_another_optimizer_family_is_refused_by_name():
    task = mlp_task()
    member = UnfusedMember(task, dict(CONFIGS["adam"]), SEED)
    member.run_iteration()
    with pytest.raises(ValueError, match="'adam'"):
        UnfusedMember(task, dict(CONFIGS["sgd"]), state=member.member_state())
