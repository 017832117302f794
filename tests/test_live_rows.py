"""An iteration costs what its live members cost (docs/design.md D5, D8; issue 39).

A group smaller than the stack trains on a stack gathered from its own rows,
put back once it completes; a lone member of an ``"auto"`` bucket takes the
eager route. Every member still follows its unfused reference, and the rows
that sit an iteration out (retired, waiting, left out) stay frozen bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.bucket import MemberMetricError
from chorus_tune.optim import FAMILIES

import models
from models import cnn, digits, params_close

RTOL = 1e-5
ROUTES = ["vmap", "eager"]
MLP_ROUTES = ["vmap", "batched", "eager"]  # batched.py runs the MLP, not the CNN


def mlp_task() -> ct.Task:
    return models.mlp_task(batch_size=32, iteration_steps=5)


def cnn_task() -> ct.Task:
    return ct.Task(cnn, digits(images=True), optimizer="adam", batch_size=32, iteration_steps=3)


def configs(n: int) -> list[dict]:
    return [dict(lr=0.01 * (i + 1), momentum=0.9, weight_decay=1e-4 * i, seed=i) for i in range(n)]


def filled(task: ct.Task, capacity: int, members: list[dict], route: str) -> ct.Bucket:
    """A bucket of ``capacity`` slots holding ``members``, in that order."""
    bucket = ct.Bucket(task, capacity, route=route)
    for config in members:
        bucket.add(config)
    return bucket


def rows(bucket: ct.Bucket, slot: int) -> list[torch.Tensor]:
    """Every tensor that makes ``slot`` itself: parameters, buffers, optimizer state."""
    return [t[slot].detach().clone() for t in (*bucket.stack.state_tensors(), *bucket.optimizer.tensors())]


def same_order(a: dict, b: dict) -> bool:
    """Whether two batch-order states are the same place in the data."""
    def same(x, y):
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def assert_follows_reference(task, bucket, slot, config, history):
    expected, model = reference.train(task, config, iterations=len(history))
    for ours, theirs in zip(history, expected):
        assert math.isclose(ours["val_loss"], theirs["val_loss"], rel_tol=RTOL), (slot, ours, theirs)
    params_close(bucket.export_model(slot), model, RTOL)


@pytest.mark.parametrize("route", MLP_ROUTES)
def test_an_iteration_of_few_live_members_computes_their_rows_only(route):
    bucket = filled(mlp_task(), 8, configs(8), route)
    for slot in range(2, 8):
        bucket.retire(slot)
    bucket.run_iteration()
    assert bucket.last_rows == 2


def test_a_full_stack_iteration_counts_every_row():
    bucket = filled(mlp_task(), 4, configs(4), "vmap")
    bucket.run_iteration()
    assert bucket.last_rows == 4


@pytest.mark.parametrize("route", MLP_ROUTES)
def test_live_members_of_a_sparse_bucket_train_as_a_bucket_of_just_them(route):
    # Bit for bit: gathered, the two live rows of eight run the very call a
    # bucket of two runs (the same shapes, the same batches, the same rates).
    task = mlp_task()
    sparse, dense = ct.Bucket(task, 8, route=route), ct.Bucket(task, 2, route=route)
    chosen = configs(8)
    for config in chosen:
        sparse.add(config)
    for slot in (0, 1, 2, 4, 6, 7):
        sparse.retire(slot)
    for config in (chosen[3], chosen[5]):
        dense.add(config)
    for _ in range(2):
        ours, theirs = sparse.run_iteration(), dense.run_iteration()
        assert [ours[3]["val_loss"], ours[5]["val_loss"]] == [theirs[0]["val_loss"], theirs[1]["val_loss"]]
    for a, b in ((3, 0), (5, 1)):
        for x, y in zip(rows(sparse, a), rows(dense, b)):
            assert torch.equal(x, y)


ROUTE_TASKS = [pytest.param(route, make_task, id=f"{name}-{route}")
               for make_task, name in ((mlp_task, "mlp"), (cnn_task, "cnn_batchnorm"))
               for route in (MLP_ROUTES if make_task is mlp_task else ROUTES)]


@pytest.mark.parametrize("route, make_task", ROUTE_TASKS)
def test_members_trained_in_a_chosen_subset_follow_their_references(route, make_task):
    # A subset trains gathered while the others sit out; later the others catch
    # up in a subset of their own. Each member stays on its own trajectory.
    task = make_task()
    chosen = configs(4)
    bucket = ct.Bucket(task, 4, route=route)
    slots = [bucket.add(c) for c in chosen]
    history = {k: [] for k in slots}
    for subset in ([0, 2], [0, 2], [1, 3], [1, 3], [0, 1, 2, 3]):
        for k, metrics in bucket.run_iteration(subset).items():
            history[k].append(metrics)
    for k in slots:
        assert_follows_reference(task, bucket, k, chosen[k], history[k])


@pytest.mark.parametrize("route, make_task", ROUTE_TASKS)
def test_rows_outside_the_gathered_group_stay_bit_for_bit_frozen(route, make_task):
    bucket = filled(make_task(), 4, configs(4), route)
    bucket.run_iteration()
    bucket.retire(3)
    waiting, retired = rows(bucket, 1), rows(bucket, 3)
    order = bucket.members[1].order.state_dict()
    bucket.run_iteration([0, 2])
    assert all(torch.equal(a, b) for a, b in zip(rows(bucket, 1), waiting))
    assert all(torch.equal(a, b) for a, b in zip(rows(bucket, 3), retired))
    assert same_order(bucket.members[1].order.state_dict(), order) and bucket.iteration(1) == 1


def test_a_lone_member_of_an_auto_bucket_trains_unfused():
    task = mlp_task()
    chosen = configs(4)
    bucket = filled(task, 4, chosen, "auto")
    bucket.run_iteration()
    fused = bucket.route
    assert fused in ("vmap", "batched", "eager")
    history = [bucket.run_iteration([2])[2] for _ in range(2)]
    assert [h["route"] for h in history] == ["unfused", "unfused"] and bucket.last_route == "unfused"
    assert bucket.last_rows == 1 and bucket.route == fused  # the bucket's route stands for the next full iteration
    expected, _ = reference.train(task, chosen[2], iterations=3)
    assert [h["val_loss"] for h in history] == pytest.approx([e["val_loss"] for e in expected[1:]], rel=RTOL)


def test_a_lone_member_trains_eager_until_torch_optim_is_warm_in_the_process(torch_optim_cold):
    # The first torch.optim use imports torch._dynamo (1.0 s alone, 3.2-3.5 s for
    # each of two buckets' last survivors under ChorusASHA): not worth it for a
    # lone member's epochs, a fifth cheaper unfused (bucket_lone.py).
    task = mlp_task()
    chosen = configs(2)
    bucket = filled(task, 2, chosen, "auto")
    bucket.run_iteration()
    lone = bucket.run_iteration([1])[1]
    assert lone["route"] == "eager" and bucket.last_route == "eager" and bucket.last_routes == 1
    assert bucket.last_rows == 1
    expected, _ = reference.train(task, chosen[1], iterations=2)
    assert lone["val_loss"] == pytest.approx(expected[1]["val_loss"], rel=RTOL)


@pytest.mark.parametrize("optimizer", list(FAMILIES))
def test_a_member_moving_between_fused_and_unfused_iterations_follows_its_reference(optimizer):
    # Fused, then alone (unfused: its state read out of the stack and written
    # back), then fused again: one trajectory, the reference's, for every
    # optimizer family (their state crosses between the two forms each time).
    task = models.mlp_task(batch_size=32, iteration_steps=5, optimizer=optimizer)
    chosen = [dict(lr=0.003 * (i + 1), weight_decay=1e-4 * i, seed=i) for i in range(3)]
    bucket = filled(task, 3, chosen, "auto")
    history = {k: [] for k in range(3)}
    for slots in (None, [1], [1], None, [0], None):
        for k, metrics in bucket.run_iteration(slots).items():
            history[k].append(metrics)
    assert [h["route"] for h in history[1]][1:3] == ["unfused", "unfused"]
    assert len(history[1]) == 5 and len(history[0]) == 4 and len(history[2]) == 3
    for k in range(3):
        assert_follows_reference(task, bucket, k, chosen[k], history[k])
        expected, model = reference.train(task, chosen[k], iterations=len(history[k]))
        params_close(bucket.export_model(k), model, RTOL)


def test_the_members_that_sit_out_a_lone_member_s_unfused_iteration_stay_frozen_bit_for_bit():
    bucket = filled(mlp_task(), 4, configs(3), "auto")
    bucket.run_iteration()
    before = {k: (rows(bucket, k), bucket.members[k].order.state_dict()) for k in (0, 2, 3)
              if bucket.members[k] is not None}
    empty = rows(bucket, 3)
    bucket.run_iteration([1])
    assert bucket.last_route == "unfused"
    for k, (state, order) in before.items():
        assert all(torch.equal(a, b) for a, b in zip(rows(bucket, k), state))
        assert same_order(bucket.members[k].order.state_dict(), order)
    assert all(torch.equal(a, b) for a, b in zip(rows(bucket, 3), empty))


def test_a_lone_member_s_unfused_iteration_that_raises_leaves_it_where_it_was(monkeypatch):
    from chorus_tune.unfused import UnfusedMember

    task = mlp_task()
    bucket = filled(task, 2, configs(2), "auto")
    bucket.run_iteration()
    state, order = rows(bucket, 1), bucket.members[1].order.state_dict()
    real = UnfusedMember.run_iteration

    def failing(self):
        real(self)  # it trains, then fails: nothing of it may reach the bucket
        raise _Boom("after training")

    monkeypatch.setattr(UnfusedMember, "run_iteration", failing)
    with pytest.raises(_Boom):
        bucket.run_iteration([1])
    monkeypatch.setattr(UnfusedMember, "run_iteration", real)
    assert all(torch.equal(a, b) for a, b in zip(rows(bucket, 1), state))
    assert same_order(bucket.members[1].order.state_dict(), order) and bucket.iteration(1) == 1
    out = bucket.run_iteration([1])
    expected, _ = reference.train(task, configs(2)[1], iterations=2)
    assert out[1]["val_loss"] == pytest.approx(expected[1]["val_loss"], rel=RTOL)


def test_a_lone_member_on_shared_batches_trains_on_the_eager_route():
    # A Dataset split: the bucket draws one stream of batches for all its
    # members, which a member trained on its own would not see.
    (x, y), val = digits(n_train=256)
    task = ct.Task(models.mlp, (models.PairDataset(x, y), val), batch_size=32, iteration_steps=3, data_seed=7)
    bucket = ct.Bucket(task, 2, route="auto")
    bucket.add(configs(1)[0])
    assert bucket.run_iteration()[0]["route"] == "eager"


def test_a_lone_member_keeps_the_route_asked_for():
    bucket = ct.Bucket(mlp_task(), 4, route="vmap")
    bucket.add(configs(1)[0])
    assert bucket.run_iteration()[0]["route"] == "vmap"


class _Boom(RuntimeError):
    pass


def test_an_iteration_that_raises_leaves_every_member_where_it_was(monkeypatch):
    # Not an allocation failure: the iteration propagates the error, and no
    # member has moved, its place in the data included (a retry or a retire
    # of the culprit leaves its mates on their references).
    task = mlp_task()
    chosen = configs(3)
    bucket = filled(task, 4, chosen, "vmap")
    bucket.run_iteration()
    before = {k: (rows(bucket, k), bucket.members[k].order.state_dict()) for k in range(3)}
    real_step = ct.Bucket._train_step
    calls = {"n": 0}

    def failing_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Boom("a step that fails part-way")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(ct.Bucket, "_train_step", failing_step)
    with pytest.raises(_Boom):
        bucket.run_iteration()
    monkeypatch.setattr(ct.Bucket, "_train_step", real_step)
    for k, (state, order) in before.items():
        assert all(torch.equal(a, b) for a, b in zip(rows(bucket, k), state))
        assert same_order(bucket.members[k].order.state_dict(), order) and bucket.iteration(k) == 1
    out = bucket.run_iteration()
    expected = {k: reference.train(task, chosen[k], iterations=2)[0][1]["val_loss"] for k in range(3)}
    assert {k: out[k]["val_loss"] for k in out} == pytest.approx(expected, rel=RTOL)


def test_a_member_alone_from_the_start_is_not_probed_until_a_second_one_joins():
    # A sweep that splits into one-member buckets pays for no route probe: the
    # lone member trains unfused (always correct); the second member's arrival probes.
    task = mlp_task()
    chosen = configs(2)
    bucket = ct.Bucket(task, 4, route="auto")
    bucket.add(chosen[0])
    first = bucket.run_iteration()[0]
    assert first["route"] == "unfused" and bucket.route is None and not bucket.routing.timed
    bucket.add(chosen[1])
    bucket.run_iteration()
    assert bucket.route in ("vmap", "batched", "eager") and bucket.routing.timed
    expected, _ = reference.train(task, chosen[0], iterations=2)
    assert bucket.iteration(0) == 2 and first["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=RTOL)


def _finite_only(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    if not torch.isfinite(outputs).all():
        raise ValueError("non-finite outputs")
    return float((outputs.argmax(1) == targets).float().mean())


def test_a_lone_member_whose_metric_raises_fails_with_its_message_after_training():
    task = ct.Task(models.mlp, digits(), batch_size=32, iteration_steps=10, metrics={"strict": _finite_only})
    bucket = ct.Bucket(task, 2, route="auto")
    bucket.add(dict(lr=1e12, seed=3))  # diverges: its outputs are not finite
    with pytest.raises(MemberMetricError) as caught:
        bucket.run_iteration()
    error = caught.value
    assert bucket.last_route == "unfused" and error.slots == (0,) and error.results == {}
    assert "metric 'strict' raised ValueError: non-finite outputs" in error.errors[0]
    assert "slot 0" in error.errors[0] and "seed 3" in error.errors[0]
    assert bucket.iteration(0) == 1  # it trained, as a member of a fused group whose metric fails does


def test_a_bucket_keeps_one_unfused_copy_at_a_time(unfused_copies):
    # Each unfused copy is a second copy of a member's model and optimizer
    # state, outside the bucket's memory fit: lone members in turn share one.
    import gc

    built = unfused_copies
    bucket = filled(mlp_task(), 3, configs(3), "auto")
    for slot in (0, 1, 2, 2):
        bucket.run_iteration([slot])
    gc.collect()
    assert len(built) == 3 and [ref() is not None for ref in built] == [False, False, True]
    bucket.retire(2)
    gc.collect()
    assert built[2]() is None


def test_a_group_trains_one_by_one_unfused_where_the_bucket_measured_that_cheaper():
    task = mlp_task()
    chosen = configs(3)
    bucket = filled(task, 3, chosen, "auto")
    bucket.run_iteration()
    fused = bucket.route
    bucket.group_costs.record("unfused", 1, 0.001)  # as if measured: far cheaper than any fused group
    bucket.group_costs.record(fused, 2, 10.0)
    out = bucket.run_iteration([0, 2])
    assert {m["route"] for m in out.values()} == {"unfused"} and bucket.last_rows == 2
    assert bucket.route == fused  # the bucket's route stands for the groups it is cheaper for
    for k in (0, 2):
        expected, _ = reference.train(task, chosen[k], iterations=2)
        assert out[k]["val_loss"] == pytest.approx(expected[1]["val_loss"], rel=RTOL)


def test_a_group_the_fused_route_runs_cheaper_stays_fused():
    bucket = filled(mlp_task(), 3, configs(3), "auto")
    bucket.run_iteration()
    bucket.group_costs.record("unfused", 1, 10.0)
    bucket.group_costs.record(bucket.route, 2, 0.001)
    out = bucket.run_iteration([0, 2])
    assert {m["route"] for m in out.values()} == {bucket.route}


def test_a_route_asked_for_ignores_the_measured_costs():
    bucket = filled(mlp_task(), 3, configs(3), "vmap")
    bucket.group_costs.record("unfused", 1, 0.001)
    bucket.group_costs.record("vmap", 2, 10.0)
    assert {m["route"] for m in bucket.run_iteration([0, 2]).values()} == {"vmap"}


@pytest.mark.parametrize("route, shared_batches, warms", [("auto", False, True), ("vmap", False, False),
                                                          ("auto", True, False)])
def test_a_bucket_warms_the_unfused_path_only_where_a_member_may_train_unfused(route, shared_batches, warms):
    if shared_batches:
        (x, y), val = digits(n_train=256)
        task = ct.Task(models.mlp, (models.PairDataset(x, y), val), batch_size=32, iteration_steps=3)
    else:
        task = mlp_task()
    bucket = ct.Bucket(task, 2, route=route)
    bucket.add(configs(1)[0])  # a bucket knows its split once it holds a member
    assert bucket.warm_unfused() is warms


def test_warming_pays_torch_optims_first_use_so_a_first_unfused_member_imports_nothing():
    # In a fresh process: torch.optim's first optimizer imports torch._dynamo
    # (0.65 s measured), which a bucket's first lone member paid on its trial's
    # critical path. The control run shows that first use still imports modules
    # (if torch stops doing so, warm_torch_optim has no reason left).
    import subprocess
    import sys

    code = """
import sys, torch
from chorus_tune.unfused import warm_torch_optim
if sys.argv[1] == "warm":
    warm_torch_optim()
before = set(sys.modules)
weight = torch.zeros(2, requires_grad=True)
optimizer = torch.optim.Adam([weight], lr=0.1)
weight.grad = torch.ones(2)
optimizer.step()
print(len(set(sys.modules) - before))
"""
    new = {how: int(subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                                   check=True).stdout.strip()) for how in ("warm", "cold")}
    assert new["cold"] > 0 and new["warm"] == 0, new
