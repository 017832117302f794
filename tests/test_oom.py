"""Running out of memory inside an iteration loses nothing (docs/design.md D13).

A fake device stands in for the GPU: a fused call costs one unit per member row
it computes, plus each member's ``cost`` buffer, and the model's forward raises
``torch.OutOfMemoryError`` when the call it runs in costs more than the room
(from a chosen call on). The calls are counted by wrapping ``torch.vmap`` and
``MemberStack.eager_call``, so a group that still computes every row of the
stack would run out again: the test sees what the bucket really computes.
"""
from __future__ import annotations

import math
import pickle
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import chorus_tune as ct
import chorus_tune.bucket_iteration as iteration_module  # where an iteration recovers from running out
from chorus_tune import reference
from chorus_tune import stack as stack_module
from chorus_tune.batched import BatchedEligibility
from chorus_tune.bucket import MemberOutOfMemory
from chorus_tune.memory import is_out_of_memory
from chorus_tune.route import RouteReason
from chorus_tune.stack import MemberStack
from chorus_tune.unfused import UnfusedMember

from models import PairDataset, SmallCNN, digits, mlp, params_close

RTOL = 1e-5
CNN_RTOL = 1e-4  # test_fidelity.py: convolutions and BatchNorm, documented there
DIGITS, IMAGES = digits(), digits(images=True)  # once per module: importing scikit-learn takes seconds


class FakeDevice:
    """Room for ``room`` units; runs out from the ``arm``-th counted call on,
    in the phases listed (``train``: calls with autograd on, ``eval``: off)."""

    def __init__(self):
        self.room: float | None = None
        self.arm = 1
        self.phases = ("train",)
        self.calls = 0
        self.over = False
        self.rows: list[int] = []  # rows of each counted call
        self.pinned: list[weakref.ref] = []

    @contextmanager
    def call(self, rows: int, load: float):
        phase = "train" if torch.is_grad_enabled() else "eval"
        counted = self.room is not None and phase in self.phases
        if counted:
            self.calls += 1
            self.rows.append(rows)
        self.over = counted and self.calls >= self.arm and load > self.room
        try:
            yield
        finally:
            self.over = False


DEVICE = FakeDevice()


class Guarded(nn.Module):
    """``inner``, plus the fake allocation failure and a per-member cost."""

    def __init__(self, inner: nn.Module, cost: float = 0.0):
        super().__init__()
        self.inner = inner
        self.register_buffer("cost", torch.tensor(float(cost)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if DEVICE.over:
            scratch = torch.empty(1 << 12)  # what the failed step was holding
            DEVICE.pinned.append(weakref.ref(scratch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (fake)")
        return self.inner(x)


def guarded_mlp(config: dict) -> nn.Module:
    return Guarded(mlp(config), config.get("cost", 0.0))


def guarded_cnn(config: dict) -> nn.Module:
    return Guarded(SmallCNN(config.get("channels", 4)), config.get("cost", 0.0))


@pytest.fixture
def device(monkeypatch):
    real_vmap = torch.vmap

    def vmap(func, in_dims=0, **kwargs):
        batched = real_vmap(func, in_dims=in_dims, **kwargs)

        def call(params, buffers, *args):
            rows = next(iter(params.values())).shape[0]
            with DEVICE.call(rows, rows + float(buffers["cost"].sum())):
                return batched(params, buffers, *args)
        return call

    real_eager = MemberStack.eager_call

    def eager_call(self, fn, x, y, shared, slots):
        load = len(slots) + sum(float(self.buffers["cost"][k]) for k in slots)
        with DEVICE.call(len(slots), load):
            return real_eager(self, fn, x, y, shared, slots)

    real_unfused = UnfusedMember.run_iteration

    def unfused_iteration(self):  # a lone member trained unfused (chorus_tune/bucket_lone.py)
        with DEVICE.call(1, 1 + float(self.model.cost)):
            return real_unfused(self)

    monkeypatch.setattr(torch, "vmap", vmap)
    monkeypatch.setattr(MemberStack, "eager_call", eager_call)
    # Guarded's forward reads DEVICE.over at every call, which a traced forward
    # (the batched route, chorus_tune/batched.py) would read once: the fake
    # device runs out on the vmap and eager routes only.
    monkeypatch.setattr(stack_module, "batched_forward",
                        lambda template: BatchedEligibility(None, "the fake device counts vmap and eager calls"))
    monkeypatch.setattr(UnfusedMember, "run_iteration", unfused_iteration)
    DEVICE.__init__()
    yield DEVICE
    DEVICE.__init__()


def mlp_task(**kwargs) -> ct.Task:
    kwargs.setdefault("batch_size", 64)
    kwargs.setdefault("iteration_steps", 3)
    return ct.Task(guarded_mlp, DIGITS, **kwargs)


def rows_of(bucket: ct.Bucket, slot: int) -> list[torch.Tensor]:
    return [t[slot].detach().clone() for t in (*bucket.stack.state_tensors(), *bucket.optimizer.tensors())]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def train(bucket: ct.Bucket, iterations: int, slots=None) -> dict[int, list[dict]]:
    histories: dict[int, list[dict]] = {}
    for _ in range(iterations):
        asked = bucket.live_slots if slots is None else slots
        out = bucket.run_iteration(slots)
        assert sorted(out) == sorted(asked)  # one result per requested member, each once
        for slot, metrics in out.items():
            histories.setdefault(slot, []).append(metrics)
    return histories


def assert_follows_reference(task, bucket, slot, config, history, rtol=RTOL):
    expected, model = reference.train(task, config, iterations=len(history))
    for ours, theirs in zip(history, expected):
        assert math.isclose(ours["val_loss"], theirs["val_loss"], rel_tol=rtol), (ours, theirs)
        assert math.isclose(ours["train_loss"], theirs["train_loss"], rel_tol=rtol), (ours, theirs)
        assert ours["iteration"] == theirs["iteration"]
    params_close(bucket.export_model(slot), model, rtol)


def test_out_of_memory_mid_iteration_finishes_in_smaller_groups_on_the_reference(device):
    # SGD with dampening: a momentum buffer starts as a copy of the first
    # gradient, so a restore that forgot has_buffer would dampen the retried
    # first step and leave the reference.
    task = mlp_task(optimizer="sgd")
    configs = [dict(lr=0.05 * (i + 1), momentum=0.9, dampening=0.1, seed=i) for i in range(4)]
    bucket = ct.Bucket(task, 4, route="vmap")
    slots = [bucket.add(c) for c in configs]
    device.room, device.arm = 2, 3  # the third step of the first iteration runs out
    histories = train(bucket, 2)
    assert bucket.oom_recoveries == 1 and bucket.max_group == 2
    # After the failed call every fused call ran a group of two rows: the
    # remembered size is used directly, with no second failure.
    assert device.rows[:3] == [4, 4, 4] and set(device.rows[3:]) == {2}
    assert bucket.fused_steps == 2 * 2 * 3
    for slot, config in zip(slots, configs):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_the_eager_route_puts_back_only_the_groups_rows_and_follows_the_reference(device):
    task = mlp_task(optimizer="sgd")
    configs = [dict(lr=0.05 * (i + 1), momentum=0.9, dampening=0.1, seed=i) for i in range(4)]
    bucket = ct.Bucket(task, 4, route="eager")
    slots = [bucket.add(c) for c in configs]
    bucket.run_iteration()
    bucket.retire(slots[3])
    retired = rows_of(bucket, slots[3])
    device.room, device.arm = 2, 2  # three live of four: the eager step's rows are the group's own
    histories = train(bucket, 1)
    assert bucket.oom_recoveries == 1 and bucket.max_group == 2
    assert same(rows_of(bucket, slots[3]), retired)
    for slot, config in zip(slots[:3], configs):
        expected, model = reference.train(task, config, iterations=2)
        assert math.isclose(histories[slot][0]["val_loss"], expected[1]["val_loss"], rel_tol=RTOL)
        params_close(bucket.export_model(slot), model, RTOL)


def test_out_of_memory_puts_back_batchnorm_statistics_and_adam_steps(device):
    task = ct.Task(guarded_cnn, IMAGES, optimizer="adam", batch_size=32, iteration_steps=4)
    configs = [dict(lr=1e-3 * (i + 1), seed=i) for i in range(3)]
    bucket = ct.Bucket(task, 3, route="vmap")
    slots = [bucket.add(c) for c in configs]
    device.room, device.arm = 2, 7  # the third step of the second iteration
    histories = train(bucket, 2)
    assert bucket.oom_recoveries == 1 and bucket.max_group == 2
    for slot, config in zip(slots, configs):
        assert bucket.optimizer.steps[slot].item() == 8
        assert bucket.export_model(slot).inner.bn.num_batches_tracked.item() == 8
        # params_close covers the running mean and variance too
        assert_follows_reference(task, bucket, slot, config, histories[slot], rtol=CNN_RTOL)


def test_out_of_memory_in_evaluation_puts_back_the_iterations_training(device):
    task = mlp_task(optimizer="adam")
    configs = [dict(lr=1e-3 * (i + 1), seed=i) for i in range(3)]
    bucket = ct.Bucket(task, 3, route="vmap")
    slots = [bucket.add(c) for c in configs]
    device.room, device.phases = 1, ("eval",)
    histories = train(bucket, 1)
    assert bucket.oom_recoveries == 2 and bucket.max_group == 1
    for slot, config in zip(slots, configs):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_a_member_that_runs_out_alone_fails_alone_and_the_rest_complete(device):
    task = mlp_task(optimizer="adam")
    configs = [dict(lr=1e-3 * (i + 1), seed=i, cost=100 if i == 1 else 0) for i in range(4)]
    bucket = ct.Bucket(task, 4, route="vmap")
    for c in configs:
        bucket.add(c)
    histories = train(bucket, 1)
    device.room = 3
    before = rows_of(bucket, 1)
    order_before = bucket.members[1].order.state_dict()
    with pytest.raises(MemberOutOfMemory) as info:
        bucket.run_iteration()
    error = info.value
    assert error.slots == (1,) and error.slot == 1
    assert sorted(error.results) == [0, 2, 3]
    message = str(error)
    assert "slot 1" in message and "Guarded" in message and "K=4" in message and "GiB" in message
    # The failed member is exactly as the iteration found it: it can be retried or moved.
    assert same(rows_of(bucket, 1), before) and bucket.iteration(1) == 1
    assert torch.equal(bucket.members[1].order.state_dict()["generator"], order_before["generator"])
    assert bucket.members[1].order.pos == order_before["pos"]
    copy = pickle.loads(pickle.dumps(error))  # a bucket actor's error crosses processes
    assert copy.slots == (1,) and sorted(copy.results) == [0, 2, 3] and str(copy) == message
    for slot, metrics in error.results.items():
        histories[slot].append(metrics)
    bucket.retire(1)
    for slot, more in train(bucket, 1).items():
        histories[slot].extend(more)
    for slot in (0, 2, 3):
        assert_follows_reference(task, bucket, slot, configs[slot], histories[slot])


def test_members_left_out_of_an_iteration_that_runs_out_stay_frozen(device):
    task = mlp_task(optimizer="sgd")
    configs = [dict(lr=0.05, momentum=0.5, seed=i) for i in range(4)]
    bucket = ct.Bucket(task, 4, route="vmap")
    for c in configs:
        bucket.add(c)
    device.room = 2
    frozen = rows_of(bucket, 1)
    histories = train(bucket, 2, slots=[0, 2, 3])
    assert same(rows_of(bucket, 1), frozen) and bucket.iteration(1) == 0
    assert bucket.oom_recoveries == 1
    for slot in (0, 2, 3):
        assert_follows_reference(task, bucket, slot, configs[slot], histories[slot])


def test_batchnorm_rows_of_members_left_out_stay_frozen_when_a_gathered_step_runs_out(device):
    # A group smaller than the stack trains on copies of its own rows (train-mode
    # BatchNorm writes their statistics there), put back only once it completes:
    # running out part-way must leave every row of the bucket as it was, the
    # left-out member's included, and the retried groups must still be exact.
    task = ct.Task(guarded_cnn, IMAGES, optimizer="adam", batch_size=32, iteration_steps=3)
    bucket = ct.Bucket(task, 3, route="vmap")
    for seed in range(3):
        bucket.add(dict(lr=1e-3, seed=seed))
    frozen = rows_of(bucket, 2)
    device.room, device.arm = 1, 2  # the second step of [0, 1], gathered as two rows
    out = bucket.run_iteration([0, 1])
    assert sorted(out) == [0, 1] and bucket.oom_recoveries == 1 and bucket.max_group == 1
    assert device.rows[:2] == [2, 2] and set(device.rows[2:]) == {1}
    assert same(rows_of(bucket, 2), frozen)


def test_shared_batches_are_replayed_to_every_group(device):
    (x, y), val = digits(n_train=512)
    task = ct.Task(guarded_mlp, (PairDataset(x, y), val), batch_size=64, iteration_steps=3, data_seed=7)
    configs = [dict(lr=0.05, seed=1), dict(lr=0.02, momentum=0.9, seed=3)]
    bucket = ct.Bucket(task, 2, route="vmap")
    slots = [bucket.add(c) for c in configs]
    device.room, device.arm = 1, 2
    histories = train(bucket, 2)
    assert bucket.max_group == 1
    for slot, config in zip(slots, configs):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_a_route_probe_that_runs_out_of_memory_halves_instead_of_choosing_eager(device):
    task = mlp_task(optimizer="sgd")
    configs = [dict(lr=0.05 * (i + 1), seed=i) for i in range(4)]
    bucket = ct.Bucket(task, 4, route="auto")
    slots = [bucket.add(c) for c in configs]
    device.room = 2
    histories = train(bucket, 1)
    assert bucket.route_reason is RouteReason.FASTER and bucket.max_group == 2
    assert bucket.oom_recoveries == 1  # the probe found the size; training never ran out
    for slot, config in zip(slots, configs):
        assert_follows_reference(task, bucket, slot, config, histories[slot])


def test_a_probe_that_runs_out_even_alone_falls_back_to_eager(device):
    task = mlp_task()
    bucket = ct.Bucket(task, 2, route="auto")
    bucket.add(dict(seed=0))
    big = bucket.add(dict(seed=1, cost=100))
    device.room = 3
    with pytest.raises(MemberOutOfMemory) as info:
        bucket.run_iteration()
    assert info.value.slots == (big,) and bucket.route == "eager"
    assert bucket.route_reason is RouteReason.PROBE_OUT_OF_MEMORY


def test_the_failed_steps_tensors_are_unpinned_before_memory_is_released(device, monkeypatch):
    seen = []
    real = iteration_module.release_memory

    def release(dev):
        seen.append([ref() is None for ref in device.pinned])
        real(dev)

    monkeypatch.setattr(iteration_module, "release_memory", release)
    bucket = ct.Bucket(mlp_task(), 2, route="vmap")
    for seed in range(2):
        bucket.add(dict(seed=seed))
    device.room = 1
    bucket.run_iteration()
    assert seen and all(all(freed) and freed for freed in seen)


def test_other_errors_are_not_retried(device):
    armed = []  # from the iteration on: the first member's join runs a forward of two rows (Task.check_model)

    def bug(*_):
        if armed:
            raise ValueError("a bug")

    def factory(config):
        model = guarded_mlp(config)
        model.inner[0].register_forward_hook(bug)
        return model

    bucket = ct.Bucket(ct.Task(factory, DIGITS, batch_size=32, iteration_steps=2), 2, route="vmap")
    for seed in range(2):
        bucket.add(dict(seed=seed))
    armed.append(True)
    device.room = 100
    with pytest.raises(ValueError, match="a bug"):
        bucket.run_iteration()
    assert bucket.oom_recoveries == 0 and bucket.max_group is None


def test_out_of_memory_classification():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("the user's forward failed") from oom
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the types that allocation failures raise


def test_rows_put_back_are_bit_exact_including_the_momentum_bookkeeping():
    bucket = ct.Bucket(ct.Task(mlp, DIGITS, batch_size=32, iteration_steps=2), 3, route="vmap")
    for seed in range(3):
        bucket.add(dict(lr=0.1, momentum=0.9, dampening=0.1, seed=seed))
    before = [rows_of(bucket, k) for k in range(3)]
    saved = bucket._snapshot_state([1, 2], to_host=True)
    bucket.run_iteration()
    after0 = rows_of(bucket, 0)
    assert bucket.optimizer._without_buffer == set()
    bucket._restore_state(saved)
    assert same(rows_of(bucket, 0), after0) and not same(after0, before[0])
    assert same(rows_of(bucket, 1), before[1]) and same(rows_of(bucket, 2), before[2])
    assert bucket.optimizer._without_buffer == {1, 2}


def test_a_lone_member_that_runs_out_unfused_leaves_no_copy_of_itself_behind(device, unfused_copies):
    import gc

    built = unfused_copies
    bucket = ct.Bucket(mlp_task(), 2, route="auto")
    big = bucket.add(dict(seed=1, cost=100))
    device.room = 3
    with pytest.raises(MemberOutOfMemory) as info:
        bucket.run_iteration()
    gc.collect()
    assert info.value.slots == (big,)
    assert built and all(ref() is None for ref in built)
