"""A member's training settings are read from its config once (chorus_tune.member_spec; issue 44)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.member_spec import MemberSpec


def task(**kwargs) -> ct.Task:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return ct.Task(lambda config: nn.Linear(4, 3), ((x, y), (x[:16], y[:16])), batch_size=16, **kwargs)


def test_defaults_fill_in_per_optimizer_family_and_the_config_overrides_them():
    spec = MemberSpec.read(task(optimizer="adamw"), {"lr": 0.01, "batch_size": 8, "label_smoothing": 0.1}, seed=4)
    assert (spec.family, spec.seed, spec.batch_size, spec.label_smoothing) == ("adamw", 4, 8, 0.1)
    assert spec.hp["lr"] == 0.01 and spec.hp["weight_decay"] == 0.01 and spec.hp["max_grad_norm"] is None
    assert MemberSpec.read(task(), {}, seed=0).hp["lr"] == 0.01  # SGD's default


def test_a_bad_training_key_is_refused_naming_it():
    with pytest.raises(ValueError, match="max_grad_norm"):
        MemberSpec.read(task(), {"max_grad_norm": -1.0}, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        MemberSpec.read(task(), {"batch_size": 16.7}, seed=0)


def test_the_spec_keeps_its_own_copy_of_the_config():
    config = {"lr": 0.1}
    spec = MemberSpec.read(task(), config, seed=0)
    config["lr"] = 0.5
    assert spec.config == {"lr": 0.1}


def test_bucket_and_reference_train_from_the_same_settings():
    config = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "max_grad_norm": 0.5, "seed": 1}
    bucket = ct.Bucket(task(), capacity=1, route="eager")
    member = bucket.members[bucket.add(config)]
    run = reference.ReferenceRun(task(), config)
    spec = MemberSpec.read(task(), config, seed=1)
    assert member.hp == run.hp == spec.hp and member.family == spec.family == "sgd"


def test_the_keys_tune_adds_are_not_the_user_s():
    from chorus_tune.config_keys import is_tune_key, users_config

    assert users_config({"lr": 0.1, "__trial_index__": 3, 7: "x"}) == {"lr": 0.1, 7: "x"}
    assert is_tune_key("__trial_index__") and not is_tune_key("lr") and not is_tune_key(7)
