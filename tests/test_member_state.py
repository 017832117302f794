"""A state that is not a member state is refused with what it lacks (docs/design.md D7, "Faults")."""
from __future__ import annotations

import pytest

import chorus_tune as ct
from chorus_tune.member_state import MEMBER_STATE_KEYS, check_member_state

from models import tiny_mlp as mlp
from models import tiny_task as task


@pytest.fixture(scope="module")
def real_state():
    bucket = ct.Bucket(task(), capacity=2, route="eager")
    slot = bucket.add(dict(lr=0.1, momentum=0.9, seed=3))
    bucket.run_iteration()
    return bucket.member_state(slot)


def test_a_real_member_state_passes(real_state):
    assert check_member_state(real_state) is None
    assert set(MEMBER_STATE_KEYS) <= set(real_state)


@pytest.mark.parametrize("key", list(MEMBER_STATE_KEYS))
def test_each_missing_key_is_named(real_state, key):
    state = {k: v for k, v in real_state.items() if k != key}
    with pytest.raises(ValueError, match=f"not a chorus member state: missing key\\(s\\) '{key}'") as info:
        check_member_state(state)
    assert "Bucket.member_state" in str(info.value)


def test_a_plain_state_dict_is_recognised_as_one():
    with pytest.raises(ValueError, match="looks like a model's state_dict") as info:
        check_member_state(mlp({}).state_dict())
    assert "'model'" in str(info.value) and "'optimizer'" in str(info.value)


def test_not_a_dict_at_all():
    with pytest.raises(TypeError, match="expected a dict, got list"):
        check_member_state([1, 2])


@pytest.mark.parametrize("change, message", [
    (dict(model=[1]), "'model' must be a state_dict"),
    (dict(optimizer={"family": "sgd"}), "'optimizer' must be a StackedOptimizer.member_state dict"),
    (dict(seed="three"), "member state 'seed' must be an integer"),
    (dict(iteration=-1), "'iteration' must be a non-negative integer"),
    (dict(step=2.5), "'step' must be a non-negative integer"),
    (dict(config=None), "'config' must be a dict"),
])
def test_wrong_values_are_named(real_state, change, message):
    with pytest.raises(ValueError, match=message):
        check_member_state({**real_state, **change})


def test_bucket_restore_names_the_missing_keys():
    bucket = ct.Bucket(task(), capacity=2, route="eager")
    with pytest.raises(ValueError, match="missing key\\(s\\) 'config', 'seed', 'optimizer'"):
        bucket.restore({"model": mlp({}).state_dict()})
    assert bucket.live_slots == []
