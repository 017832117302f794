"""Members of other layer widths share one padded bucket, each training as its own model (docs/design.md D9).

Every fidelity test pins the route (under "auto" the probe could keep the
eager loop and a test would pass on it alone) and holds each member to
``reference.train`` of its own unpadded model. The settings are stable ones
(tests/stable_settings.py says why that matters): small learning rates, a few
iterations; measured on the 2-core CPU, the padded members matched their
references to the bit on these.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.route import RouteReason
from chorus_tune.width_rule import DEFAULT_RULE, WidthRule

import models
from models import digits, params_close

RTOL = 1e-4
ITERATIONS = 3


def sigmoid_mlp(config: dict) -> nn.Module:
    """Two hidden layers whose activation is not zero at zero: a padded unit outputs sigmoid(0) = 0.5."""
    h1, h2 = config["h1"], config.get("h2", 20)
    return nn.Sequential(nn.Linear(64, h1), nn.Sigmoid(), nn.Linear(h1, h2), nn.Sigmoid(), nn.Linear(h2, 10))


class WidthCNN(nn.Module):
    """Conv2d -> BatchNorm2d -> flatten -> Linear: padded channels are a contiguous tail of the flattened vector."""

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * 4 * 4, hidden)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.head(torch.tanh(self.bn1(self.fc(x.flatten(1)))))


def width_cnn(config: dict) -> nn.Module:
    return WidthCNN(config["channels"], config.get("hidden", 16))


class Conv1dNet(nn.Module):
    """Conv1d -> sigmoid -> BatchNorm1d: a padded channel reaches the BatchNorm as 0.5, not 0."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv1d(1, channels, 5, padding=2, bias=False)  # no bias before a BatchNorm (test_fidelity)
        self.bn = nn.BatchNorm1d(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.sigmoid(self.conv(x.unsqueeze(1)))).mean(dim=2))


class Bag(nn.Module):
    """Token ids -> Embedding -> mean -> Linear."""

    def __init__(self, dim: int):
        super().__init__()
        self.embed = nn.Embedding(17, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x).mean(dim=1)))


def token_data():
    (x, y), (xv, yv) = digits()
    return (x.mul(16).long(), y), (xv.mul(16).long(), yv)  # the digits' 0..16 pixel values as tokens


def run_and_compare(task, configs, route, width_rule=DEFAULT_RULE, rtol=RTOL):
    bucket, _ = models.run_and_compare(task, configs, ITERATIONS, rtol, route, width_rule=width_rule)
    assert bucket.stack.padded
    return bucket


# The narrowest first, the widest second: the bucket widens under its first member.
# The first member clips: a gradient leaking into padded entries would count in its norm.
SGD_CONFIGS = [dict(h1=20, lr=0.1, momentum=0.9, weight_decay=1e-3, max_grad_norm=0.05, seed=1),
               dict(h1=32, h2=24, lr=0.05, seed=2),
               dict(h1=24, h2=18, lr=0.1, momentum=0.5, weight_decay=1e-2, seed=3)]
ADAM_CONFIGS = [dict(h1=20, lr=1e-3, weight_decay=1e-2, seed=1), dict(h1=32, h2=24, lr=3e-3, seed=2),
                dict(h1=24, h2=18, lr=2e-3, beta1=0.8, seed=3)]


@pytest.mark.parametrize("route", ["vmap", "batched", "eager"])
@pytest.mark.parametrize("family", ["sgd", "adam", "adamw"])
def test_padded_members_follow_their_own_unpadded_reference(family, route):
    task = ct.Task(sigmoid_mlp, digits(), optimizer=family, batch_size=32, iteration_steps=10)
    run_and_compare(task, SGD_CONFIGS if family == "sgd" else ADAM_CONFIGS, route)


@pytest.mark.parametrize("family", ["sgd", "adamw"])
def test_padded_entries_stay_exactly_zero_with_decay_momentum_and_moments(family):
    task = ct.Task(sigmoid_mlp, digits(), optimizer=family, batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, capacity=3, route="vmap")
    for config in SGD_CONFIGS if family == "sgd" else ADAM_CONFIGS:
        bucket.add(config)
    bucket.run_iteration()
    for name, mask in bucket.stack.pad.items():
        tensor = bucket.stack.params.get(name, bucket.stack.buffers.get(name))
        assert bool((tensor.detach()[mask] == 0).all()), name
        for state in bucket.optimizer.state.get(name, {}).values():
            assert bool((state[mask] == 0).all()), name


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_padded_conv_batchnorm_flatten_members_follow_their_reference(route):
    task = ct.Task(width_cnn, digits(images=True), optimizer="sgd", batch_size=32, iteration_steps=8)
    configs = [dict(channels=5, hidden=8, lr=0.05, momentum=0.9, seed=1), dict(channels=8, hidden=16, lr=0.03, seed=2),
               dict(channels=6, hidden=12, lr=0.05, momentum=0.9, weight_decay=1e-3, seed=3)]
    run_and_compare(task, configs, route)


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_padded_conv1d_members_with_batchnorm_after_a_nonzero_activation_follow_their_reference(route):
    task = ct.Task(lambda c: Conv1dNet(c["channels"]), digits(), optimizer="adam", batch_size=32, iteration_steps=8)
    configs = [dict(channels=5, lr=3e-3, seed=1), dict(channels=12, lr=1e-3, seed=2)]
    run_and_compare(task, configs, route)


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_padded_embedding_members_follow_their_reference(route):
    task = ct.Task(lambda c: Bag(c["dim"]), token_data(), optimizer="adamw", batch_size=32, iteration_steps=8)
    configs = [dict(dim=6, lr=3e-3, seed=1), dict(dim=12, lr=1e-3, seed=2), dict(dim=8, lr=2e-3, seed=3)]
    run_and_compare(task, configs, route)


# ----- a member's own shapes out, and back in -------------------------------------------------------
def _sigmoid_task(**kwargs) -> ct.Task:
    kwargs.setdefault("iteration_steps", 5)
    return ct.Task(sigmoid_mlp, digits(), optimizer=kwargs.pop("optimizer", "sgd"), batch_size=32, **kwargs)


def test_a_padded_members_state_and_export_hold_its_own_shapes():
    task = _sigmoid_task()
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    narrow = bucket.add(dict(h1=20, lr=0.1, momentum=0.9, seed=1))
    bucket.add(dict(h1=32, lr=0.1, seed=2))
    bucket.run_iteration()
    own = {n: tuple(t.shape) for n, t in sigmoid_mlp(dict(h1=20)).state_dict().items()}
    state = bucket.member_state(narrow)
    assert {n: tuple(t.shape) for n, t in state["model"].items()} == own
    assert {n: tuple(t["momentum_buffer"].shape) for n, t in state["optimizer"]["tensors"].items()} == own
    assert {n: tuple(t.shape) for n, t in bucket.export_model(narrow).state_dict().items()} == own


@pytest.mark.parametrize("into", ["unpadded", "padded", "widened"])
def test_a_member_state_restores_into_a_padded_or_unpadded_bucket_and_continues_its_reference(into):
    task = _sigmoid_task(optimizer="adam")
    config = dict(h1=20, lr=3e-3, seed=1)
    first = ct.Bucket(task, capacity=2, route="vmap")
    slot = first.add(config)
    first.add(dict(h1=32, h2=24, lr=1e-3, seed=2))
    first.run_iteration()
    state = first.member_state(slot)
    second = ct.Bucket(task, capacity=2, route="vmap")
    if into == "padded":
        second.add(dict(h1=24, h2=32, lr=1e-3, seed=3))  # wider than it in both hidden layers
    if into == "widened":
        second.add(dict(h1=20, h2=18, lr=1e-3, seed=3))  # narrower in one: restoring it widens the bucket
    restored = second.restore(state)
    assert second.stack.padded == (into != "unpadded")
    results = [second.run_iteration()[restored] for _ in range(2)]
    history, model = reference.train(task, config, iterations=3)
    assert [r["val_loss"] for r in results] == pytest.approx([h["val_loss"] for h in history[1:]], rel=RTOL)
    params_close(second.export_model(restored), model, RTOL)


# ----- what cannot pad splits, and says why -----------------------------------------------------------
def test_a_layernorm_over_a_width_is_refused_naming_it():
    task = ct.Task(lambda c: nn.Sequential(nn.Linear(64, c["h"]), nn.LayerNorm(c["h"]), nn.Linear(c["h"], 10)),
                   digits(), batch_size=32)
    bucket = ct.Bucket(task, capacity=2)
    bucket.add(dict(h=16, seed=1))
    with pytest.raises(ValueError, match=r"LayerNorm.*normalized_shape"):
        bucket.add(dict(h=32, seed=2))


class Interleaved(nn.Module):
    """Channels become the inner dimension of the flatten: padded channels interleave with the real ones."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv1d(1, channels, 3, padding=1)
        self.head = nn.Linear(64 * channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.unsqueeze(1)).transpose(1, 2).flatten(1))


@pytest.mark.parametrize("first, second", [(5, 8), (8, 5)], ids=["widening-checks-the-members-here",
                                                                    "a-narrower-newcomer-is-checked"])
def test_a_flatten_that_interleaves_a_padded_dimension_is_refused_by_the_padding_check(first, second):
    task = ct.Task(lambda c: Interleaved(c["channels"]), digits(), batch_size=32)
    bucket = ct.Bucket(task, capacity=2)
    bucket.add(dict(channels=first, seed=1))
    with pytest.raises(ValueError, match="mixes a padded dimension"):
        bucket.add(dict(channels=second, seed=2))
    assert bucket.stack.shapes["conv.weight"] == (first, 1, 3)  # refused before anything changed
    assert len(bucket.live_slots) == 1


def test_an_output_whose_width_would_pad_is_refused():
    task = ct.Task(lambda c: nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, c["classes"])),
                   digits(), batch_size=32)
    bucket = ct.Bucket(task, capacity=2)
    bucket.add(dict(classes=10, seed=1))
    with pytest.raises(ValueError, match="output must not change width"):
        bucket.add(dict(classes=12, seed=2))


def test_widths_that_would_cost_more_than_the_rule_allows_are_refused():
    bucket = ct.Bucket(_sigmoid_task(), capacity=2)
    bucket.add(dict(h1=4, h2=4, seed=1))
    with pytest.raises(ValueError, match=r"a member costing 312 would cost 8.448e\+04 \(271x its own; the limit on "
                                         r"cpu is 1.25x for a padded step of 2.7e\+06 multiply-adds\)"):
        bucket.add(dict(h1=256, h2=256, seed=2))
    generous = ct.Bucket(_sigmoid_task(), capacity=2, width_rule=WidthRule(factor=1000, cpu_compute_factor=1000))
    generous.add(dict(h1=4, h2=4, seed=1))
    generous.add(dict(h1=256, h2=256, seed=2))


def test_a_bucket_without_a_width_rule_takes_one_width_only():
    bucket = ct.Bucket(_sigmoid_task(), capacity=2, width_rule=None)
    bucket.add(dict(h1=16, seed=1))
    with pytest.raises(ValueError, match="does not pad"):
        bucket.add(dict(h1=32, seed=2))


# ----- the route probe, compaction, subsets, the report ---------------------------------------------
@pytest.mark.parametrize("model", ["sigmoid_mlp", "conv1d_batchnorm"])
def test_the_route_probe_finds_padded_members_agree_with_their_own_models(model):
    # The probe compares every row of every tensor after a step, padded entries
    # included: BatchNorm statistics of a padded channel that sees sigmoid(0)
    # move on the vmap route and not on the eager one, unless they are re-zeroed.
    if model == "sigmoid_mlp":
        task, configs = _sigmoid_task(), SGD_CONFIGS
    else:
        task = ct.Task(lambda c: Conv1dNet(c["channels"]), digits(), optimizer="adam", batch_size=32,
                       iteration_steps=4)
        configs = [dict(channels=5, lr=3e-3, seed=1), dict(channels=12, lr=1e-3, seed=2)]
    bucket = ct.Bucket(task, capacity=len(configs))
    for config in configs:
        bucket.add(config)
    bucket.run_iteration()
    assert bucket.routing.rejected == {}
    assert bucket.route_reason is RouteReason.FASTER


def test_padded_members_compact_and_train_alone_as_their_reference():
    task = _sigmoid_task(optimizer="adam")
    bucket = ct.Bucket(task, capacity=3, route="vmap")
    slots = [bucket.add(c) for c in ADAM_CONFIGS]
    bucket.run_iteration()
    bucket.retire(slots[1])  # the widest leaves; the stack stays as wide
    moved = bucket.compact()
    narrow, other = moved[slots[0]], moved[slots[2]]
    bucket.run_iteration([narrow])  # one row of two: a gathered group of its own
    bucket.run_iteration()
    for slot, config, iterations in ((narrow, ADAM_CONFIGS[0], 3), (other, ADAM_CONFIGS[2], 2)):
        history, model = reference.train(task, config, iterations=iterations)
        params_close(bucket.export_model(slot), model, RTOL)


@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_a_wider_newcomer_widens_the_bucket_under_trained_members_who_keep_their_trajectory(family):
    task = _sigmoid_task(optimizer=family)
    configs = SGD_CONFIGS if family == "sgd" else ADAM_CONFIGS
    narrow, wide = configs[0], configs[1]  # h1 20 -> 32, h2 20 -> 24
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    slot = bucket.add(narrow)
    bucket.run_iteration()  # alone: it has optimizer state (momentum, Adam's moments) when the stack widens
    newcomer = bucket.add(wide)
    assert bucket.stack.padded and bucket.stack.shapes["0.weight"] == (32, 64)
    for _ in range(2):
        bucket.run_iteration()
    for s, config, iterations in ((slot, narrow, 3), (newcomer, wide, 2)):
        _, model = reference.train(task, config, iterations=iterations)
        params_close(bucket.export_model(s), model, RTOL)


def test_the_route_report_says_what_each_member_pays_for_its_padding():
    bucket = ct.Bucket(_sigmoid_task(), capacity=2, route="vmap")
    narrow = bucket.add(dict(h1=20, seed=1))
    wide = bucket.add(dict(h1=32, seed=2))
    padding = bucket.route_report()["padding"]
    own = sum(p.numel() for p in sigmoid_mlp(dict(h1=20)).parameters())
    padded = sum(p.numel() for p in sigmoid_mlp(dict(h1=32)).parameters())
    assert padding[narrow]["own_params"] == own and padding[narrow]["padded_params"] == padded
    assert padding[wide]["factor"] == 1.0
    assert padding[narrow]["factor"] == pytest.approx((64 * 32 + 32 * 20 + 20 * 10) / (64 * 20 + 20 * 20 + 20 * 10),
                                                      rel=1e-3)
    assert "runs padded" in bucket.describe_padding(narrow)


def test_a_bucket_that_cannot_place_a_mismatching_member_elsewhere_runs_every_member_eager_and_exact():
    task = ct.Task(lambda c: Interleaved(c["channels"]), digits(), batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, capacity=2, padding_mismatch="eager")
    configs = [dict(channels=5, lr=0.05, seed=1), dict(channels=8, lr=0.02, seed=2)]
    slots = [bucket.add(c) for c in configs]
    results = [bucket.run_iteration() for _ in range(2)]
    assert bucket.route == "eager" and bucket.route_reason is RouteReason.PADDING_DISAGREES
    assert "mixes a padded dimension" in bucket.route_report()["rejected"]["vmap"]["detail"]
    for slot, config in zip(slots, configs):
        history, model = reference.train(task, config, iterations=2)
        assert [r[slot]["val_loss"] for r in results] == pytest.approx([h["val_loss"] for h in history], rel=RTOL)
        params_close(bucket.export_model(slot), model, RTOL)


def test_the_route_report_never_copies_the_template_once_the_bucket_trains(monkeypatch):
    # A bucket actor's describe() reads the route report beside a running
    # iteration, whose functional_call has batched tensors in the template:
    # a copy taken then failed ("Cannot access storage of BatchedTensorImpl").
    from chorus_tune import widths

    # Members of one width: nothing priced a padding when they joined.
    bucket = ct.Bucket(_sigmoid_task(), capacity=2, route="vmap")
    first = bucket.add(dict(h1=20, seed=1))
    bucket.add(dict(h1=20, seed=2))
    bucket.run_iteration()

    def copied_again(cls, module, row):
        raise AssertionError("the template was profiled again")

    monkeypatch.setattr(widths.Profile, "of", classmethod(copied_again))
    assert bucket.route_report()["padding"][first]["factor"] == 1
