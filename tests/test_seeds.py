"""A seed that is not an integer is refused, naming the config key."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.seeds import as_seed, config_seed


@pytest.mark.parametrize("value, seed", [(7, 7), (np.int64(7), 7), (3.0, 3), (np.float32(4.0), 4), ("12", 12),
                                         (-1, -1)])
def test_integers_in_any_form_are_seeds(value, seed):
    assert as_seed(value) == seed and type(as_seed(value)) is int


@pytest.mark.parametrize("value", ["abc", 3.5, float("nan"), True, None, [1], "1.5"])
def test_anything_else_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"config key 'seed' must be an integer .*got "):
        as_seed(value)


def test_config_seed():
    assert config_seed({}) is None and config_seed({"seed": None}) is None
    assert config_seed({"seed": 5}) == 5
    with pytest.raises(ValueError, match="config key 'seed'.*'abc' of type str"):
        config_seed({"seed": "abc"})


def mlp_task():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = lambda config: nn.Linear(4, 3)  # noqa: E731
    return ct.Task(model, ((x, y), (x[:16], y[:16])), batch_size=16, iteration_steps=1)


def test_reference_names_the_seed_key():
    with pytest.raises(ValueError, match="config key 'seed' must be an integer.*'abc'"):
        reference.train(mlp_task(), {"lr": 0.1, "seed": "abc"})
    history, _ = reference.train(mlp_task(), {"lr": 0.1, "seed": 2.0})
    assert history[0]["seed"] == 2


def test_bucket_add_names_the_seed_key():
    bucket = ct.Bucket(mlp_task(), capacity=2, route="eager")
    with pytest.raises(ValueError, match="config key 'seed' must be an integer"):
        bucket.add({"lr": 0.1, "seed": "abc"})


# ----- one seed rule for every reader (seeds.chosen_seed) --------------------------------------------
def test_a_given_seed_comes_first_then_the_config_s_then_the_reader_s_own():
    from chorus_tune.seeds import chosen_seed

    assert chosen_seed({"seed": 5}, given=9, otherwise=lambda: 1) == 9
    assert chosen_seed({"seed": 5}, otherwise=lambda: 1) == 5
    assert chosen_seed({"seed": None}, otherwise=lambda: 1) == 1  # None in the config is no seed
    assert chosen_seed({}, otherwise=lambda: 1) == 1
    with pytest.raises(ValueError, match="a seed is needed"):
        chosen_seed({})


def test_the_bucket_the_reference_and_the_tune_layer_read_a_seed_alike():
    from chorus_tune.tune.values.options import derived_seed, member_seed

    bucket = ct.Bucket(mlp_task(), capacity=2, route="eager")
    for config in ({"lr": 0.1, "seed": 3.0}, {"lr": 0.1, "seed": "3"}):
        slot = bucket.add(config)
        assert bucket.members[slot].seed == 3 == reference.ReferenceRun(mlp_task(), config).seed
        assert member_seed(config, "trial_1") == 3
        bucket.retire(slot)
    assert member_seed({"seed": None}, "trial_1") == derived_seed("trial_1")
    slot = bucket.add({"lr": 0.1, "seed": None})  # no seed: a fresh one, reported
    assert isinstance(bucket.members[slot].seed, int)
