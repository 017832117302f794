"""The stacked optimizers: the family registry is the one table, and the update
functions take torch.optim's steps, member by member (docs/design.md D6)."""
from __future__ import annotations

import pytest
import torch

from chorus_tune import optim, schedules, task
from chorus_tune.optim import FAMILIES, StackedOptimizer

CONFIGS = {
    "sgd": [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.0, dampening=0.3, weight_decay=1e-2),
            dict(lr=0.02, momentum=0.8, nesterov=True, weight_decay=1e-3)],
    "adam": [dict(lr=1e-2), dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=1e-2), dict(lr=1e-3)],
    "adamw": [dict(lr=1e-2), dict(lr=3e-3, beta1=0.8, beta2=0.99, weight_decay=0.1), dict(lr=1e-3, weight_decay=0.0)],
}


def test_names_other_modules_import_still_import():
    from chorus_tune.optim import (  # noqa: F401
        HYPERPARAMETER_DEFAULTS,
        OPTIMIZERS,
        SCHEDULES,
        build_torch_optimizer,
        hyperparameters,
        scheduled_lr,
    )

    assert task.OPTIMIZERS == OPTIMIZERS == tuple(FAMILIES) == ("sgd", "adam", "adamw")
    assert SCHEDULES == schedules.SCHEDULES and scheduled_lr is schedules.scheduled_lr
    assert HYPERPARAMETER_DEFAULTS == {name: dict(f.defaults) for name, f in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_one_consistent_entry(family):
    spec = FAMILIES[family]
    hp = optim.hyperparameters(family, {})
    assert {k: v for k, v in hp.items() if k not in ("schedule", "max_grad_norm")} == dict(spec.defaults)
    # The stock optimizer the reference builds keeps the state the stacked one keeps.
    model = torch.nn.Linear(3, 2)
    reference = optim.build_torch_optimizer(family, model.parameters(), dict(hp, momentum=0.9)
                                            if family == "sgd" else hp)
    assert isinstance(reference, torch.optim.Optimizer) and reference.defaults["lr"] == spec.defaults["lr"]
    model(torch.ones(1, 3)).sum().backward()
    reference.step()
    assert set(reference.state[model.weight]) - {"step"} == set(spec.state_names)
    stacked = StackedOptimizer(family, {"w": torch.zeros(4, 2, 3)})
    assert set(spec.tensor_hyperparameters) == set(spec.defaults) - {"lr"}
    assert set(stacked.hp) == set(spec.tensor_hyperparameters) | set(spec.derived)
    assert set(stacked.state["w"]) == set(spec.state_names)


def test_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="sgd.*adam.*adamw.*'rmsprop'"):
        optim.hyperparameters("rmsprop", {})
    with pytest.raises(ValueError, match="optimizer must be one of"):
        task.Task(lambda c: torch.nn.Linear(1, 1), data=None, optimizer="rmsprop")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stacked_step_takes_each_members_torch_step(family):
    """Three members with their own hyperparameters, one of them sitting steps
    out (masked): each follows its own stock torch.optim run."""
    configs = CONFIGS[family]
    k, shape, steps = len(configs), (5, 4), 6
    g = torch.Generator().manual_seed(0)
    start = torch.randn(k, *shape, generator=g)
    grads = torch.randn(steps, k, *shape, generator=g)
    sits_out = {(2, 1), (3, 1), (4, 0)}  # (step, member): the member is masked on that step

    stacked = {"w": start.clone()}
    opt = StackedOptimizer(family, stacked)
    hps = [optim.hyperparameters(family, c) for c in configs]
    for slot, hp in enumerate(hps):
        opt.set_member(slot, hp)
    lr = torch.tensor([hp["lr"] for hp in hps])
    for s in range(steps):
        live = [m for m in range(k) if (s, m) not in sits_out]
        active = torch.zeros(k, dtype=torch.bool)
        active[live] = True
        stacked["w"].grad = grads[s].clone()
        opt.step(lr, active, live)

    for m, hp in enumerate(hps):
        param = torch.nn.Parameter(start[m].clone())
        reference = optim.build_torch_optimizer(family, [param], hp)
        for s in range(steps):
            if (s, m) in sits_out:
                continue
            param.grad = grads[s, m].clone()
            reference.step()
        torch.testing.assert_close(stacked["w"][m], param.detach(), rtol=1e-6, atol=1e-7)
        taken = sum(1 for s in range(steps) if (s, m) not in sits_out)
        assert opt.member_state(m)["step"] == taken
        # The state too, not only the parameters: it crosses to torch.optim when a
        # member trains unfused. Adam's exp_avg_sq, from 1 - beta2 taken in float32,
        # was 1.3e-5 off torch's while the parameters agreed (the bias correction,
        # from the same float32 beta2, cancelled it).
        for name, value in reference.state[param].items():
            if name != "step" and value is not None:
                torch.testing.assert_close(opt.state["w"][name][m], value, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_stacked_optimizer_pickles_and_copies(family):
    import copy
    import pickle

    opt = StackedOptimizer(family, {"w": torch.zeros(2, 3)})
    opt.set_member(1, optim.hyperparameters(family, {"lr": 0.1}))
    for twin in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert twin.spec is FAMILIES[family]
        assert all(torch.equal(a, b) for a, b in zip(twin.tensors(), opt.tensors()))
