"""Bad inputs, one row each: a clear error that names the bad value and what to
pass instead, raised before anything changes, or a harmless outcome. A bad
member fails alone: where a row is about harm, its bucket-mate is held to its
reference trajectory (issue 40, "Bad inputs").

Rows run on the vmap route, where a bad value did harm (a label of -1 trained
as class 0 there; a zero schedule length broke every mate's iteration).
"""
from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chorus_tune as ct
from chorus_tune import memory, reference
from chorus_tune.schedules import scheduled_lr

from models import digits, mlp

MATE = dict(lr=0.05, momentum=0.9, seed=1)
RTOL = 1e-5


def small_data(n_train: int = 256, n_val: int = 64):
    return digits(n_train, n_val)


def small_task(data=None, **kwargs) -> ct.Task:
    kwargs.setdefault("batch_size", 32)
    kwargs.setdefault("iteration_steps", 4)
    return ct.Task(kwargs.pop("model", mlp), data if data is not None else small_data(), **kwargs)


def val_losses(history: list[dict[str, Any]]) -> list[float]:
    return [h["val_loss"] for h in history]


@dataclass(frozen=True)
class Refused:
    """The clear error a row expects: its type, and a regex on its message."""

    error: type
    match: str


# ----- configs: refused at Bucket.add, the mate untouched ------------------------------------------------
# Each row's config joins a bucket whose mate has trained one iteration.
REFUSED_CONFIGS: dict[str, tuple[dict, Refused]] = {
    # Harm before: accepted, then every run_iteration of the bucket raised ZeroDivisionError.
    "cosine t_max 0": (dict(lr_schedule="cosine", t_max=0),
                       Refused(ValueError, r"t_max \(optimizer steps to anneal over\) must be a positive integer; "
                                           r"got 0")),
    "step step_size 0": (dict(lr_schedule="step", step_size=0),
                         Refused(ValueError, r"step_size \(optimizer steps between decays\) must be a positive "
                                             r"integer; got 0")),
    # Silent before: each was accepted and trained something else than asked.
    "lr True": (dict(lr=True), Refused(ValueError, r"lr must be a finite non-negative number \(default 0.01\); "
                                                   r"got True")),
    "batch_size 16.7": (dict(batch_size=16.7), Refused(ValueError, r"'batch_size' must be a positive integer; "
                                                                   r"got 16.7")),
    "batch_size 0": (dict(batch_size=0), Refused(ValueError, r"'batch_size' must be a positive integer; got 0")),
    "warmup_steps -1": (dict(warmup_steps=-1), Refused(ValueError, r"warmup_steps .* must be an integer >= 0; "
                                                                   r"got -1")),
    "gamma -0.5": (dict(lr_schedule="step", step_size=2, gamma=-0.5),
                   Refused(ValueError, r"gamma must be a finite non-negative number \(default 0.1\); got -0.5")),
    "lr_min -0.01": (dict(lr_schedule="cosine", t_max=8, lr_min=-0.01),
                     Refused(ValueError, r"lr_min must be a finite non-negative number \(default 0.0\); got -0.01")),
    "t_max 2.5": (dict(lr_schedule="cosine", t_max=2.5), Refused(ValueError, r"t_max .* positive integer; got 2.5")),
    "lr inf": (dict(lr=float("inf")), Refused(ValueError, r"lr must be a finite non-negative number .* got inf")),
    "lr as a string": (dict(lr="0.1"), Refused(ValueError, r"lr must be a finite non-negative number .* got '0.1'")),
    "momentum nan": (dict(momentum=float("nan")), Refused(ValueError, r"momentum must be .* got nan")),
    "max_grad_norm True": (dict(max_grad_norm=True), Refused(ValueError, r"max_grad_norm must be a non-negative "
                                                                         r"number, or None .* got True")),
}


@pytest.mark.parametrize("name", sorted(REFUSED_CONFIGS))
def test_a_bad_config_is_refused_at_add_and_its_mate_stays_on_its_reference(name):
    change, refused = REFUSED_CONFIGS[name]
    task = small_task()
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    mate = bucket.add(MATE)
    first = bucket.run_iteration()[mate]
    with pytest.raises(refused.error, match=refused.match):
        bucket.add({"lr": 0.1, "seed": 2, **change})
    assert bucket.live_slots == [mate]
    second = bucket.run_iteration()[mate]
    history, _ = reference.train(task, MATE, iterations=2)
    assert val_losses([first, second]) == pytest.approx(val_losses(history), rel=RTOL)


# ----- configs that are fine: numbers of other types are taken as the numbers they are ------------------
# (the config, the plain config it must train exactly as)
ACCEPTED_CONFIGS: dict[str, tuple[dict, dict]] = {
    "lr numpy float32": (dict(lr=np.float32(0.125)), dict(lr=0.125)),
    "lr 0-d tensor": (dict(lr=torch.tensor(0.125)), dict(lr=0.125)),
    "max_grad_norm numpy": (dict(max_grad_norm=np.float64(0.5)), dict(max_grad_norm=0.5)),
    "max_grad_norm 0-d tensor": (dict(max_grad_norm=torch.tensor(0.5)), dict(max_grad_norm=0.5)),
    "batch_size 32.0 (tune.quniform)": (dict(batch_size=32.0), dict(batch_size=32)),
    "t_max numpy int": (dict(lr_schedule="cosine", t_max=np.int64(6)), dict(lr_schedule="cosine", t_max=6)),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED_CONFIGS))
def test_numbers_of_numpy_or_torch_are_taken_as_numbers(name):
    given, plain = ACCEPTED_CONFIGS[name]
    task = small_task()
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    bucket.add(MATE)
    slot = bucket.add(dict(given, seed=3))
    fused = [bucket.run_iteration()[slot] for _ in range(2)]
    history, _ = reference.train(task, dict(plain, seed=3), iterations=2)
    assert val_losses(fused) == pytest.approx(val_losses(history), rel=RTOL)


def test_an_exploding_step_schedule_reaches_inf_instead_of_raising_in_every_iteration():
    # gamma 10 every step: 10.0 ** 400 raised OverflowError, in the whole bucket's iteration.
    schedule = {"kind": "step", "step_size": 1, "gamma": 10.0, "warmup_steps": 0}
    assert scheduled_lr(0.1, schedule, 400) == float("inf")


def test_an_iteration_whose_plan_raises_leaves_every_member_where_it_was(monkeypatch):
    # Before: the learning-rate table was drawn after every member's batch
    # order had moved on, so a raise there left the mates off their reference.
    task = small_task()
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    mate = bucket.add(MATE)
    bucket.add(dict(lr=0.1, seed=2))
    first = bucket.run_iteration()[mate]

    def broken(*args):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr("chorus_tune.bucket_step.scheduled_lr", broken)  # the learning rates of a plan
    with pytest.raises(ZeroDivisionError, match="planted"):
        bucket.run_iteration()
    monkeypatch.undo()
    second = bucket.run_iteration()[mate]
    history, _ = reference.train(task, MATE, iterations=2)
    assert val_losses([first, second]) == pytest.approx(val_losses(history), rel=RTOL)


# ----- data: refused when the first member joins (and by reference.train), naming the split ----------
def _relabel(split: int, row: int, label: int) -> Callable:
    def change(data):
        (x, y), (xv, yv) = data
        y, yv = y.clone(), yv.clone()
        (y if split == 0 else yv)[row] = label
        return (x, y), (xv, yv)
    return change


def _both_targets(make: Callable) -> Callable:
    def change(data):
        (x, y), (xv, yv) = data
        return (x, make(y)), (xv, make(yv))
    return change


def _inputs(make: Callable) -> Callable:
    def change(data):
        (x, y), (xv, yv) = data
        return (make(x), y), (make(xv), yv)
    return change


def _soft(width: int) -> Callable:
    def change(data):
        (x, y), (xv, yv) = data
        return (x, torch.softmax(torch.randn(len(y), width), 1)), (xv, torch.softmax(torch.randn(len(yv), width), 1))
    return change


REFUSED_DATA: dict[str, tuple[Callable, Refused]] = {
    # Silent before: -1 gathered class 0 on the vmap route (torch and the reference refuse it).
    "train label -1": (_relabel(0, 5, -1), Refused(ValueError, r"the train split has the negative label -1 \(at "
                                                               r"row 5\).* in \[0, C\), or -100")),
    # Silent before: validation labels were never checked.
    "val label -1": (_relabel(1, 7, -1), Refused(ValueError, r"the val split has the negative label -1 \(at row 7\)")),
    "train label 10 of 10 classes": (_relabel(0, 3, 10), Refused(ValueError, r"the train split has label 10 \(at "
                                                                             r"row 3\).* outputs 10 classes.*"
                                                                             r"\[0, 10\)")),
    "val label 12 of 10 classes": (_relabel(1, 0, 12), Refused(ValueError, r"the val split has label 12 \(at row 0\)")),
    "(N, 1) labels": (_both_targets(lambda y: y.unsqueeze(1)),
                      Refused(ValueError, r"targets have shape \(1,\) per row.*class indices of shape \(\) per row "
                                          r"\(y.squeeze\(1\), or y.reshape\(-1\)\)")),
    "feature width 63": (_inputs(lambda x: x[:, :63]),
                         Refused(ValueError, r"forward failed on the first 2 rows of the train split \(inputs of "
                                             r"shape \(2, 63\).*feature width")),
    "float64 inputs": (_inputs(lambda x: x.double()),
                       Refused(TypeError, r"inputs are torch.float64 but the model's parameters are torch.float32: "
                                          r"pass the inputs as torch.float32 \(X.float\(\)")),
    "soft labels of 7 classes for 10": (_soft(7), Refused(ValueError, r"class-probability targets have shape \(7,\) "
                                                                      r"per row, but the model outputs \(10,\).*"
                                                                      r"\(N, 10\)")),
    "val inputs of another width": (lambda data: (data[0], (data[1][0][:, :60], data[1][1])),
                                    Refused(ValueError, r"val split's inputs have shape \(60,\) per row but the "
                                                        r"train split's \(64,\)")),
}


@pytest.mark.parametrize("name", sorted(REFUSED_DATA))
def test_bad_data_is_refused_by_name_when_the_first_member_joins(name):
    change, refused = REFUSED_DATA[name]
    task = small_task(change(small_data()))
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    with pytest.raises(refused.error, match=refused.match):
        bucket.add(dict(MATE))
    assert bucket.live_slots == [] and bucket.stack is None  # nothing opened: a fixed task can start over
    with pytest.raises(refused.error, match=refused.match):
        reference.train(task, MATE)


def test_ignore_index_labels_are_legitimate_and_train_as_the_reference_does():
    data = _relabel(0, 5, -100)(_relabel(0, 9, -100)(small_data()))
    task = small_task(data)
    bucket = ct.Bucket(task, capacity=1, route="vmap")
    bucket.add(MATE)
    fused = [bucket.run_iteration()[0] for _ in range(2)]
    history, _ = reference.train(task, MATE, iterations=2)
    assert val_losses(fused) == pytest.approx(val_losses(history), rel=RTOL)


# ----- the task and its model ----------------------------------------------------------------------------
def _mean_loss(output, target):
    return F.cross_entropy(output, target)  # a mean: one number, not one per sample


REFUSED_TASKS: dict[str, tuple[Callable[[], Any], Refused]] = {
    "a module instance as model": (lambda: small_task(model=mlp({})),
                                   Refused(TypeError, r"Task.model must be a factory, a callable config -> "
                                                      r"nn.Module .* got Sequential")),
    "eval_batch_size 0": (lambda: small_task(eval_batch_size=0),
                          Refused(ValueError, r"eval_batch_size .* must be a positive integer; got 0")),
    "Task batch_size 16.7": (lambda: small_task(batch_size=16.7),
                             Refused(ValueError, r"Task batch_size must be a positive integer; got 16.7")),
    "iteration_steps 2.5": (lambda: small_task(iteration_steps=2.5),
                            Refused(ValueError, r"iteration_steps .* must be a positive integer; got 2.5")),
    # The rows below pass Task(...) and are refused when the first member joins.
    "a model with no parameters": (lambda: ct.Bucket(small_task(model=lambda c: nn.Flatten()), 2).add(dict(MATE)),
                                   Refused(ValueError, r"built a Flatten with no parameters: there is nothing to "
                                                       r"train")),
    # Silent before: val_loss 0.00585 against a true 2.323.
    "a loss that returns a mean": (lambda: ct.Bucket(small_task(loss=_mean_loss), 2).add(dict(MATE)),
                                   Refused(ValueError, r"'_mean_loss' returned shape \(\) for a batch of 2 rows; it "
                                                       r"must return one loss per sample, shape \(2,\)")),
}


@pytest.mark.parametrize("name", sorted(REFUSED_TASKS))
def test_a_bad_task_or_model_is_refused_by_name(name):
    make, refused = REFUSED_TASKS[name]
    with pytest.raises(refused.error, match=refused.match):
        make()


def test_a_factory_that_returns_one_cached_module_is_refused_at_the_second_member():
    # Silent before: every member started from the cached module's weights, whatever its seed.
    cached = mlp({})
    bucket = ct.Bucket(small_task(model=lambda config: cached), capacity=2, route="vmap")
    bucket.add(dict(MATE))
    with pytest.raises(ValueError, match=r"returned a Sequential it had returned before.*must build a new module"):
        bucket.add(dict(lr=0.1, seed=2))
    assert len(bucket.live_slots) == 1


# ----- config keys nothing reads: a warning, once per key ------------------------------------------------
def _adds(task: ct.Task, configs: list[dict]) -> list[str]:
    bucket = ct.Bucket(task, capacity=len(configs), route="vmap")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for config in configs:
            bucket.add(config)
    return [str(w.message) for w in caught if "read by nothing" in str(w.message)]


UNREAD_KEYS: dict[str, tuple[dict, list[str]]] = {
    # (the config each of two members joins with, the keys warned about)
    "learning_rate for lr": (dict(learning_rate=0.1), ["learning_rate"]),
    "momentum under adam": (dict(optimizer="adam", momentum=0.9), ["momentum"]),
    "t_max without a cosine schedule": (dict(t_max=10), ["t_max"]),
    "Tune's __ keys and the seed": (dict(__trial_index__=3), []),
    "a key the model factory reads": (dict(width=16), []),
    "the core's own keys": (dict(lr_schedule="step", step_size=2, gamma=0.5, warmup_steps=1, label_smoothing=0.1,
                                 max_grad_norm=1.0, batch_size=32, optimizer="sgd", lr=0.1, momentum=0.5), []),
}


@pytest.mark.parametrize("name", sorted(UNREAD_KEYS))
def test_a_config_key_nothing_reads_is_warned_about_once(name):
    config, keys = UNREAD_KEYS[name]
    messages = _adds(small_task(), [dict(config, seed=1), dict(config, seed=2)])
    assert len(messages) == len(keys), messages  # once per key, not once per member
    for key, message in zip(keys, messages):
        assert f"config key {key!r}" in message and "changes nothing in training" in message


def test_a_factory_that_copies_its_config_counts_as_reading_every_key():
    def factory(config):
        settings = dict(config)  # what it reads cannot be told: no warning rather than a false one
        return mlp(settings)

    assert _adds(small_task(model=factory), [dict(learning_rate=0.1, seed=1)]) == []


# ----- member states that are corrupt or foreign: refused by name, the bucket unchanged ---------------
def _saved(task: ct.Task, config: dict) -> dict:
    bucket = ct.Bucket(task, capacity=1, route="vmap")
    bucket.add(config)
    bucket.run_iteration()
    return bucket.member_state(0)


def _with(path: tuple, value: Any) -> Callable[[dict], dict]:
    def change(state: dict) -> dict:
        inner = state
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        return state
    return change


REFUSED_STATES: dict[str, tuple[Callable[[dict], dict], Refused]] = {
    # A bare KeyError: 'momentum_buffer' before, after the slot's rows were written.
    "adam's state into sgd": (lambda s: dict(_saved(small_task(optimizer="adam"), dict(seed=4)), config=s["config"]),
                              Refused(ValueError, r"optimizer state is 'adam''s, but this member trains with 'sgd'.*"
                                                  r"optimizer='adam'")),
    "a model of another width": (lambda s: dict(_saved(small_task(), dict(MATE, width=16)), config=s["config"]),
                                 Refused(ValueError, r"member state 'model': '0.weight' has shape \(16, 64\), but "
                                                     r"this model's is \(32, 64\)")),
    "no optimizer tensors": (_with(("optimizer", "tensors"), {}),
                             Refused(ValueError, r"'optimizer' has no state for parameter '0.weight'")),
    "a batch order over other data": (_with(("data", "perm"), torch.arange(100)),
                                      Refused(ValueError, r"batch order over 100 samples, but this task's training "
                                                          r"split has 256")),
    "a batch order without its generator": (lambda s: _with(("data",), {"perm": None, "pos": 0})(s),
                                            Refused(ValueError, r"'data' must be a BatchOrder.state_dict .* lacks "
                                                                r"'generator'")),
    "data that is not a dict": (_with(("data",), [1, 2]),
                                Refused(ValueError, r"'data' must be a batch order's state_dict, or None; got list")),
}


@pytest.mark.parametrize("name", sorted(REFUSED_STATES))
def test_a_corrupt_or_foreign_member_state_is_refused_and_the_bucket_is_unchanged(name):
    change, refused = REFUSED_STATES[name]
    task = small_task()
    bucket = ct.Bucket(task, capacity=2, route="vmap")
    mate = bucket.add(MATE)
    first = bucket.run_iteration()[mate]
    state = change(_saved(task, dict(lr=0.1, seed=2)))
    with pytest.raises(refused.error, match=refused.match):
        bucket.restore(state)
    assert bucket.live_slots == [mate]
    second = bucket.run_iteration()[mate]
    history, _ = reference.train(task, MATE, iterations=2)
    assert val_losses([first, second]) == pytest.approx(val_losses(history), rel=RTOL)


# ----- capacity without a bound ----------------------------------------------------------------------
def test_a_capacity_beyond_memory_is_refused_at_the_first_member_naming_one_that_fits(monkeypatch):
    # Before: Bucket(task, capacity=10**6) of the digits MLP allocated until
    # "DefaultCPUAllocator: can't allocate memory". Pinned to 16 GiB available,
    # so the row does not depend on this machine's memory.
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16 * memory.GIB)
    bucket = ct.Bucket(small_task(), capacity=10**6, route="vmap")
    with pytest.raises(ValueError, match=r"capacity 1000000 needs at least \d+\.\d+ GiB on cpu .* Pass a capacity "
                                         r"of at most \d+"):
        bucket.add(dict(MATE))
    assert bucket.stack is None


def test_a_capacity_that_fits_is_not_refused(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16 * memory.GIB)
    bucket = ct.Bucket(small_task(), capacity=4, route="vmap")
    bucket.add(dict(MATE))
    assert bucket.live_slots == [0]


def test_the_cpu_allocator_failure_counts_as_running_out_of_memory():
    # Before: not recognised, so the retry in smaller groups never ran.
    error = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")
    assert memory.is_out_of_memory(error)
    assert not memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_model_that_keeps_its_config_still_copies_saves_and_exports():
    # The factory is handed a recording dict: a module that keeps it must still
    # deep-copy (the bucket's skeletons), pickle and export as before.
    def factory(config):
        module = mlp(config)
        module.config = config
        return module

    bucket = ct.Bucket(small_task(model=factory), capacity=1, route="vmap")
    bucket.add(dict(MATE))
    bucket.run_iteration()
    exported = bucket.export_model(0)
    assert dict(pickle.loads(pickle.dumps(exported)).config) == MATE


@pytest.mark.parametrize("capacity", [2.5, True, 0, "4"])
def test_a_capacity_that_is_not_a_positive_integer_is_refused_by_name(capacity):
    with pytest.raises(ValueError, match=rf"capacity must be a positive integer \(the number of slots\); "
                                         rf"got {re.escape(repr(capacity))}"):
        ct.Bucket(small_task(), capacity=capacity)


# ----- checkpoints that are not ChorusTrainable checkpoints ---------------------------------------
def test_a_directory_that_is_no_checkpoint_is_refused_naming_what_it_lacks(tmp_path):
    from chorus_tune.tune import load_model

    with pytest.raises(FileNotFoundError, match="is not a ChorusTrainable checkpoint directory"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("foreign", [{}, {"model": 1}, {"chorus_format": 2}], ids=["empty", "other", "no_member"])
def test_a_foreign_checkpoint_dict_is_refused_by_name_not_a_key_error(foreign):
    from chorus_tune.tune import load_model

    with pytest.raises(ValueError, match="not a ChorusTrainable checkpoint"):
        load_model(foreign)


def test_a_checkpoint_without_its_factory_says_to_pass_model():
    from chorus_tune.tune import load_model

    with pytest.raises(ValueError, match="no model factory .* pass model="):
        load_model({"chorus_format": 2, "member": None, "factory": None})
