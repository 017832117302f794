"""Bucket behaviour: slots, masking, membership changes, portability, isolation."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.route import RouteReason

from models import MaybeResidual, PairDataset, SmallCNN, cnn, digits, mlp, mlp_task, params_close, regression_task

RTOL = 1e-5
CNN_RTOL = 1e-4  # test_fidelity.py: the CNN with BatchNorm
# The freeze and masking tests run on each route: a full-stack vmap writes
# every row's BatchNorm statistics, where eager touches the trained rows only,
# so a row the vmap route fails to put back is seen on vmap alone.
ROUTES = ["vmap", "eager"]


def optimizer_rows(bucket: ct.Bucket, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in bucket.optimizer.tensors()]


def stack_rows(bucket: ct.Bucket, slot: int) -> list[torch.Tensor]:
    return [t[slot].detach().clone() for t in bucket.stack.state_tensors()]


def assert_follows_reference(task, bucket, slot, config, fused_history, rtol=RTOL):
    history, model = reference.train(task, config, iterations=len(fused_history))
    for ours, theirs in zip(fused_history, history):
        assert math.isclose(ours["val_loss"], theirs["val_loss"], rel_tol=rtol), (ours, theirs)
        assert ours["iteration"] == theirs["iteration"]
    params_close(bucket.export_model(slot), model, rtol)


@pytest.mark.parametrize("route", ROUTES)
def test_retired_slot_is_bit_for_bit_frozen(route):
    task = ct.Task(cnn, digits(images=True), optimizer="adam", batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, 3, route=route)
    slots = [bucket.add(dict(lr=1e-3 * (i + 1), seed=i)) for i in range(3)]
    bucket.run_iteration()
    before_stack, before_opt = stack_rows(bucket, slots[1]), optimizer_rows(bucket, slots[1])
    survivor_before = stack_rows(bucket, slots[0])
    bucket.retire(slots[1])
    results = bucket.run_iteration()
    bucket.run_iteration()
    assert set(results) == {slots[0], slots[2]} and {m["route"] for m in results.values()} == {route}
    for a, b in zip(before_stack + before_opt, stack_rows(bucket, slots[1]) + optimizer_rows(bucket, slots[1])):
        assert torch.equal(a, b)
    assert not torch.equal(stack_rows(bucket, slots[0])[0], survivor_before[0])  # the others did train


@pytest.mark.parametrize("route", ROUTES)
def test_member_added_mid_run_follows_its_own_reference(route):
    task = mlp_task(optimizer="sgd", iteration_steps=10)
    bucket = ct.Bucket(task, 4, route=route)
    early = [dict(lr=0.05, seed=1), dict(lr=0.1, momentum=0.9, seed=2)]
    early_slots = [bucket.add(c) for c in early]
    histories = {s: [] for s in early_slots}
    for _ in range(3):
        for s, m in bucket.run_iteration().items():
            histories[s].append(m)
    late = dict(lr=0.03, momentum=0.5, seed=3)
    late_slot = bucket.add(late)
    histories[late_slot] = []
    for _ in range(2):
        for s, m in bucket.run_iteration().items():
            histories[s].append(m)
    assert [m["iteration"] for m in histories[late_slot]] == [1, 2]
    assert {m["route"] for h in histories.values() for m in h} == {route}
    assert_follows_reference(task, bucket, late_slot, late, histories[late_slot])
    for slot, config in zip(early_slots, early):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_member_state_moved_to_another_bucket_continues_as_if_it_never_moved():
    task = mlp_task(optimizer="adam", iteration_steps=10)
    configs = [dict(lr=1e-3, seed=1), dict(lr=3e-3, weight_decay=1e-3, seed=2)]
    staying = ct.Bucket(task, 2)
    for c in configs:
        staying.add(c)
    staying.run_iteration()
    state = staying.member_state(1)
    target = ct.Bucket(task, 3)
    target.add(dict(lr=5e-3, seed=9))
    moved_slot = target.restore(state)
    assert target.iteration(moved_slot) == 1
    for _ in range(2):
        expected = staying.run_iteration()[1]
        got = target.run_iteration()[moved_slot]
        assert got["iteration"] == expected["iteration"]
        assert math.isclose(got["val_loss"], expected["val_loss"], rel_tol=RTOL)
    params_close(target.export_model(moved_slot), staying.export_model(1), RTOL)
    history, model = reference.train(task, configs[1], iterations=3)
    params_close(target.export_model(moved_slot), model, RTOL)


def test_member_state_holds_user_key_names_and_loads_into_the_users_class():
    task = mlp_task()
    bucket = ct.Bucket(task, 2)
    slot = bucket.add(dict(lr=0.05, seed=0))
    bucket.run_iteration()
    state = bucket.member_state(slot)
    assert set(state["model"]) == set(mlp({}).state_dict())
    # Read straight off the stack (no model build), and equal to the exported model's.
    exported = bucket.export_model(slot).state_dict()
    assert all(torch.equal(state["model"][k], exported[k]) for k in exported)
    model = ct.model_from_state(task, state)
    assert isinstance(model, nn.Sequential) and not model.training
    params_close(model, bucket.export_model(slot), 0.0)


def test_diverging_member_leaves_the_others_bit_for_bit_unchanged():
    # squared error with lr=1e6 overflows to inf, then inf - inf = NaN
    task = regression_task(iteration_steps=10)
    healthy = [dict(lr=0.001, seed=1), dict(lr=0.002, momentum=0.9, seed=2), dict(lr=0.003, seed=3)]
    # Same shapes and the same code path on both sides: the only difference is
    # whether slot 3 holds a diverging member or a sane one.
    with_nan, without = ct.Bucket(task, 4, route="vmap"), ct.Bucket(task, 4, route="vmap")
    for c in healthy:
        with_nan.add(c)
        without.add(c)
    bad = with_nan.add(dict(lr=1e6, seed=4))
    without.add(dict(lr=0.001, seed=4))
    for _ in range(3):
        results = with_nan.run_iteration()
        without.run_iteration()
    assert math.isnan(results[bad]["train_loss"]) and math.isnan(results[bad]["val_loss"])
    for slot in range(3):
        assert math.isfinite(results[slot]["val_loss"])
        for a, b in zip(stack_rows(with_nan, slot), stack_rows(without, slot)):
            assert torch.equal(a, b)
        for a, b in zip(optimizer_rows(with_nan, slot), optimizer_rows(without, slot)):
            assert torch.equal(a, b)


def test_diverging_member_among_empty_slots_harms_nobody():
    task = regression_task(iteration_steps=10)
    healthy = dict(lr=0.002, momentum=0.9, seed=2)
    with_nan, without = ct.Bucket(task, 3, route="vmap"), ct.Bucket(task, 3, route="vmap")
    with_nan.add(healthy)
    without.add(healthy)
    bad = with_nan.add(dict(lr=1e6, seed=4))
    # A finite member in the same slot: both buckets train two rows of three
    # (an iteration gathers its live rows), so the healthy row's arithmetic is
    # the same batched call in both and must match bit for bit.
    without.add(dict(lr=1e-3, seed=4))
    for _ in range(3):
        with_nan.run_iteration()
        without.run_iteration()
    assert not torch.isfinite(stack_rows(with_nan, bad)[0]).all()
    for a, b in zip(stack_rows(with_nan, 0), stack_rows(without, 0)):
        assert torch.equal(a, b)


def test_per_instance_behaviour_is_caught_and_runs_eager_correctly():
    task = ct.Task(lambda c: MaybeResidual(c["residual"]), digits(), batch_size=32, iteration_steps=10)
    configs = [dict(residual=True, lr=0.05, seed=1), dict(residual=False, lr=0.05, seed=2)]
    assert task.structural_key(configs[0]) == task.structural_key(configs[1])
    bucket = ct.Bucket(task, 2)
    slots = [bucket.add(c) for c in configs]
    histories = {s: [] for s in slots}
    for _ in range(2):
        for s, m in bucket.run_iteration().items():
            histories[s].append(m)
    assert bucket.route == "eager" and bucket.route_reason is RouteReason.DISAGREES
    assert histories[slots[0]][0]["route"] == "eager"
    for slot, config in zip(slots, configs):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_newcomer_that_breaks_vmap_is_caught_after_vmap_was_chosen(vmap_times_faster):
    # The probe keeps the faster route: vmap is made the faster here, so the
    # bucket is on vmap when the newcomer joins.
    task = ct.Task(lambda c: MaybeResidual(c["residual"]), digits(), batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, 3)
    bucket.add(dict(residual=True, lr=0.05, seed=1))
    bucket.add(dict(residual=True, lr=0.05, seed=2))
    first = bucket.run_iteration()
    assert bucket.route == "vmap" and bucket.route_reason is RouteReason.FASTER
    assert {m["route"] for m in first.values()} == {"vmap"}
    late = dict(residual=False, lr=0.05, seed=3)
    slot = bucket.add(late)
    history = [bucket.run_iteration()[slot]]
    assert bucket.route == "eager" and bucket.route_reason is RouteReason.DISAGREES
    assert history[0]["route"] == "eager"
    assert_follows_reference(task, bucket, slot, late, history)


def test_config_whose_factory_raises_is_refused_with_that_error_and_bucket_unchanged():
    def factory(config):
        if config.get("width", 32) < 0:
            raise ValueError("width must be positive, got -1")
        return mlp(config)

    task = ct.Task(factory, digits(), batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, 3)
    good = dict(lr=0.05, seed=1)
    slot = bucket.add(good)
    with pytest.raises(ValueError, match="width must be positive, got -1"):
        bucket.add(dict(width=-1, lr=0.05, seed=2))
    assert bucket.live_slots == [slot]
    history = [bucket.run_iteration()[slot] for _ in range(2)]
    assert_follows_reference(task, bucket, slot, good, history)


def test_config_of_another_structure_is_refused():
    # Another depth: no padding makes these one structure (other widths pad: tests/test_widths.py).
    task = ct.Task(lambda c: nn.Sequential(*[nn.Linear(64, 64) for _ in range(c["depth"])], nn.Linear(64, 10)),
                   digits(), batch_size=64)
    bucket = ct.Bucket(task, 2)
    bucket.add(dict(depth=1, seed=0))
    with pytest.raises(ValueError, match="structure"):
        bucket.add(dict(depth=2, seed=1))
    assert len(bucket.live_slots) == 1


def test_full_bucket_refuses_another_member():
    bucket = ct.Bucket(mlp_task(), 1)
    bucket.add(dict(seed=0))
    with pytest.raises(ValueError, match="full"):
        bucket.add(dict(seed=1))


def test_structural_key_separates_width_and_joins_learning_rate():
    task = mlp_task()
    assert task.structural_key(dict(width=32, lr=0.1)) == task.structural_key(dict(width=32, lr=0.01, seed=3))
    assert task.structural_key(dict(width=32)) != task.structural_key(dict(width=64))
    assert task.structural_key(dict(batch_size=32)) != task.structural_key(dict(batch_size=64))
    assert task.structural_key(dict(optimizer="adam")) != task.structural_key(dict(optimizer="sgd"))


def test_seed_comes_from_config_else_a_fresh_one_is_reported():
    bucket = ct.Bucket(mlp_task(iteration_steps=2), 2)
    given = bucket.add(dict(seed=123))
    fresh = bucket.add(dict())
    results = bucket.run_iteration()
    assert results[given]["seed"] == 123
    seed = results[fresh]["seed"]
    assert isinstance(seed, int)
    params_close(bucket.export_model(fresh), reference.train(bucket.task, {}, seed=seed, iterations=1)[1], RTOL)


def test_shared_batch_mode_gives_every_member_the_same_batch():
    (x, y), val = digits(n_train=512)
    train = PairDataset(x, y)
    task = ct.Task(mlp, (train, val), batch_size=64, data_seed=7)
    configs = [dict(lr=0.05, seed=1), dict(lr=0.1, seed=2), dict(lr=0.02, momentum=0.9, seed=3)]
    bucket = ct.Bucket(task, 3)
    slots = [bucket.add(c) for c in configs]
    bucket._ensure_route(slots)  # the probe decodes a batch of its own
    fetched = train.fetches
    histories = {s: [] for s in slots}
    for _ in range(2):
        for s, m in bucket.run_iteration().items():
            histories[s].append(m)
    # One epoch = 8 batches of 64, decoded once for all three members.
    assert train.fetches - fetched == 2 * 512
    for slot, config in zip(slots, configs):
        # the reference draws its batches from a loader seeded by the same data_seed
        assert_follows_reference(task, bucket, slot, config, histories[slot])


@pytest.mark.parametrize("route", ROUTES)
def test_compaction_keeps_trajectories_and_renumbers_slots(route):
    task = mlp_task(optimizer="adam", iteration_steps=8)
    configs = [dict(lr=1e-3 * (i + 1), seed=i) for i in range(4)]
    bucket = ct.Bucket(task, 4, route=route)
    slots = [bucket.add(c) for c in configs]
    first = bucket.run_iteration()
    bucket.retire(slots[0])
    bucket.retire(slots[2])
    mapping = bucket.compact()
    assert mapping == {1: 0, 3: 1} and bucket.capacity == 2
    after = [bucket.run_iteration() for _ in range(2)]
    for old, new in mapping.items():
        trajectory = [first[old]] + [it[new] for it in after]
        assert {m["route"] for m in trajectory} == {route}
        assert_follows_reference(task, bucket, new, configs[old], trajectory)


def test_export_model_is_the_users_class_in_eval_mode():
    task = ct.Task(cnn, digits(images=True), batch_size=32, iteration_steps=3)
    bucket = ct.Bucket(task, 2)
    slot = bucket.add(dict(seed=0))
    bucket.run_iteration()
    model = bucket.export_model(slot)
    assert isinstance(model, SmallCNN) and not model.training
    assert model.bn.num_batches_tracked.item() == 3


def test_bad_hyperparameters_are_refused_with_a_clear_error():
    bucket = ct.Bucket(mlp_task(), 2)
    with pytest.raises(ValueError, match="nesterov"):
        bucket.add(dict(nesterov=True, momentum=0.0))
    with pytest.raises(ValueError, match="t_max"):
        bucket.add(dict(lr_schedule="cosine"))
    with pytest.raises(ValueError, match="lr must be"):
        bucket.add(dict(lr=-1.0))
    assert bucket.live_slots == []


@pytest.mark.parametrize("route", ROUTES)
def test_a_member_left_out_of_iterations_stays_frozen_then_catches_up_on_its_reference(route):
    # A CNN with BatchNorm: its statistics are what a full-stack vmap writes in the rows left out.
    task = ct.Task(cnn, digits(images=True), optimizer="adam", batch_size=32, iteration_steps=3)
    bucket = ct.Bucket(task, 3, route=route)
    configs = [dict(lr=1e-3 * (i + 1), seed=10 + i) for i in range(3)]  # at lr=1e-2, Adam amplifies rounding to 1.6e-3
    slots = [bucket.add(c) for c in configs]
    histories = {s: [] for s in slots}
    for it in range(4):
        # slot 1 sits iterations 1 and 2 out, as a member whose trial lags
        chosen = slots if it in (0, 3) else [slots[0], slots[2]]
        before = stack_rows(bucket, slots[1]) + optimizer_rows(bucket, slots[1])
        out = bucket.run_iteration(chosen)
        assert set(out) == set(chosen) and {m["route"] for m in out.values()} == {route}
        if slots[1] not in chosen:
            after = stack_rows(bucket, slots[1]) + optimizer_rows(bucket, slots[1])
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        for s in chosen:
            histories[s].append(out[s])
    for s in (slots[0], slots[2]):
        assert len(histories[s]) == 4
    for s, config in zip(slots, configs):
        assert_follows_reference(task, bucket, s, config, histories[s], CNN_RTOL)
