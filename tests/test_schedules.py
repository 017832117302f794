"""Learning-rate schedules, checked against torch's own schedulers and literal values.

The fused bucket and reference.py both read chorus_tune.schedules.scheduled_lr,
so test_fidelity.py cannot see a schedule that is wrong in both: these tests
hold it to an independent yardstick, the equivalent torch.optim.lr_scheduler
stepped on a real torch optimizer, one optimizer step at a time.
"""
from __future__ import annotations

import math

import pytest
import torch

from chorus_tune.schedules import schedule_from_config, scheduled_lr

STEPS = 40
BASE_LR = 0.1


def torch_lrs(make_scheduler, steps: int = STEPS, base_lr: float = BASE_LR) -> list[float]:
    """The learning rate each of ``steps`` optimizer steps runs with, under a stock torch scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def ours(config: dict, steps: int = STEPS, base_lr: float = BASE_LR) -> list[float]:
    schedule = schedule_from_config(config)
    return [scheduled_lr(base_lr, schedule, step) for step in range(steps)]


def test_constant_schedule_is_the_base_rate_at_every_step():
    assert ours({}) == [BASE_LR] * STEPS


def test_step_schedule_matches_torch_step_lr():
    expected = torch_lrs(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5))
    assert ours(dict(lr_schedule="step", step_size=7, gamma=0.5)) == pytest.approx(expected, rel=1e-12)
    # Literally: 7 steps at 0.1, then 7 at 0.05, then 0.025.
    assert ours(dict(lr_schedule="step", step_size=7, gamma=0.5), steps=15) == pytest.approx(
        [0.1] * 7 + [0.05] * 7 + [0.025], rel=1e-12)


def test_cosine_schedule_matches_torch_cosine_annealing_up_to_t_max_then_holds_lr_min():
    t_max, lr_min = 30, 0.01
    expected = torch_lrs(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max, eta_min=lr_min),
                         steps=t_max + 1)
    got = ours(dict(lr_schedule="cosine", t_max=t_max, lr_min=lr_min))
    assert got[:t_max + 1] == pytest.approx(expected, rel=1e-9)
    # Past t_max torch's cosine climbs back; ours stays at lr_min (docs: annealed over t_max steps).
    assert got[t_max:] == pytest.approx([lr_min] * (STEPS - t_max), rel=1e-12)
    # Literally, t_max=4 from 0.1 to 0: the half-cosine at quarters.
    assert ours(dict(lr_schedule="cosine", t_max=4), steps=6) == pytest.approx(
        [0.1, 0.1 * (1 + math.sqrt(0.5)) / 2, 0.05, 0.1 * (1 - math.sqrt(0.5)) / 2, 0.0, 0.0], abs=1e-15)


def test_warmup_matches_torch_linear_lr_from_one_over_warmup_to_the_base_rate():
    warmup = 12
    expected = torch_lrs(lambda opt: torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1))
    assert ours(dict(warmup_steps=warmup)) == pytest.approx(expected, rel=1e-9)
    # Literally, 4 steps: a quarter, a half, three quarters, then the base rate.
    assert ours(dict(warmup_steps=4), steps=6) == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1], rel=1e-12)


def test_warmup_on_top_of_cosine_is_the_product_of_torch_linear_lr_and_cosine_annealing():
    warmup, t_max = 5, 25
    linear = torch_lrs(lambda opt: torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1), base_lr=1.0)
    cosine = torch_lrs(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max), steps=t_max + 1)
    expected = [f * c for f, c in zip(linear, cosine)]
    assert ours(dict(lr_schedule="cosine", t_max=t_max, warmup_steps=warmup), steps=t_max + 1) == pytest.approx(
        expected, rel=1e-9)
