"""Fused members follow their unfused reference trajectories (docs/design.md, 'What equivalent means')."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune import reference

from models import SmallCNN, cnn, digits, mlp, params_close, regression_task, run_and_compare

MLP_RTOL = 1e-5  # docs/design.md, 'What equivalent means': float32, 100 steps, MLP
# Convolutions and BatchNorm sum in a different order batched than unbatched
# (~1e-7 per step) and momentum amplifies it; measured worst after 30 steps:
# 2.8e-6 (SGD, momentum 0.9) and 3e-7 (Adam). A conv bias right before
# BatchNorm would not hold any bound: its true gradient is zero, so it trains on
# rounding noise (1e-2 apart under Adam) -- the test CNN has none, as is usual.
CNN_RTOL = 1e-4

OPTIMIZER_CONFIGS = {
    "sgd": [dict(lr=0.05, weight_decay=0.0), dict(lr=0.1, weight_decay=1e-3),
            dict(lr=0.02, momentum=0.9), dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=1e-4)],
    "sgd_nesterov": [dict(lr=0.05, momentum=0.9, nesterov=True), dict(lr=0.02, momentum=0.5, nesterov=True),
                     dict(lr=0.1, momentum=0.8, nesterov=True, weight_decay=1e-3), dict(lr=0.01)],
    "adam": [dict(lr=1e-3), dict(lr=3e-3, beta1=0.8), dict(lr=2e-3, beta2=0.99, weight_decay=1e-3),
             dict(lr=5e-4, eps=1e-6)],
    "adamw": [dict(lr=1e-3), dict(lr=3e-3, weight_decay=0.1), dict(lr=2e-3, beta1=0.85, beta2=0.98),
              dict(lr=1e-3, weight_decay=0.0)],
}


@pytest.mark.parametrize("route", ["vmap", "batched"])
@pytest.mark.parametrize("name", sorted(OPTIMIZER_CONFIGS))
def test_fused_mlp_members_follow_their_reference_for_100_steps(name, route):
    family = "sgd" if name.startswith("sgd") else name
    task = ct.Task(mlp, digits(), optimizer=family, batch_size=32, iteration_steps=25)
    configs = [dict(c, seed=i) for i, c in enumerate(OPTIMIZER_CONFIGS[name])]
    bucket, fused = run_and_compare(task, configs, iterations=4, rtol=MLP_RTOL, route=route)
    assert fused[-1][0]["iteration"] == 4


@pytest.mark.parametrize("route", ["vmap", "eager"])
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_cnn_with_batchnorm_follows_reference_in_train_and_eval(family, route):
    task = ct.Task(cnn, digits(images=True), optimizer=family, batch_size=32, iteration_steps=10)
    lrs = [0.05, 0.1, 0.02, 0.03] if family == "sgd" else [1e-3, 3e-3, 2e-3, 5e-3]
    configs = [dict(lr=lr, momentum=0.9, seed=i) if family == "sgd" else dict(lr=lr, seed=i)
               for i, lr in enumerate(lrs)]
    # params_close covers running_mean/var and num_batches_tracked (train-mode
    # updates); val_loss is computed in eval mode with those running stats.
    run_and_compare(task, configs, iterations=3, rtol=CNN_RTOL, route=route)


def test_eager_route_follows_reference_too():
    task = ct.Task(mlp, digits(), optimizer="sgd", batch_size=32, iteration_steps=20)
    configs = [dict(lr=0.05, momentum=0.9, seed=1), dict(lr=0.1, seed=2)]
    run_and_compare(task, configs, iterations=2, rtol=MLP_RTOL, route="eager")


def test_vmapped_members_follow_their_learning_rate_schedules_as_the_reference_does():
    task = ct.Task(mlp, digits(), optimizer="sgd", batch_size=32, iteration_steps=10)
    configs = [
        dict(lr=0.1, lr_schedule="cosine", t_max=30, lr_min=0.01, seed=0),
        dict(lr=0.1, lr_schedule="step", step_size=7, gamma=0.5, seed=1),
        dict(lr=0.1, warmup_steps=12, seed=2),
        dict(lr=0.1, lr_schedule="cosine", t_max=25, warmup_steps=5, momentum=0.9, seed=3),
    ]
    run_and_compare(task, configs, iterations=3, rtol=MLP_RTOL, route="vmap")


@pytest.mark.parametrize("route", ["vmap", "batched"])
def test_fused_mse_regression_members_follow_reference(route):
    task = regression_task(iteration_steps=10)
    configs = [dict(lr=0.01, seed=0), dict(lr=0.02, seed=1)]
    bucket, fused = run_and_compare(task, configs, iterations=2, rtol=MLP_RTOL, route=route)
    assert "val_accuracy" not in fused[-1][0]


# ----- precision="bf16" ---------------------------------------------------------------------------
# Measured on a CPU (torch 2.13), the BF16_CASES members after 2 iterations
# (20 steps), as params_close measures (largest difference relative to each
# tensor's largest entry), worst member:
#
#                              from the bf16 reference     from the fp32 reference (each member)
#   eager, autocast on         0 (MLP), 1.5e-5 (CNN)       1.5e-3 .. 4.1e-2
#   vmap, autocast on          1.7e-2 (MLP), 4.0e-2 (CNN)  1.5e-3 .. 7.8e-3
#   either, autocast missing   1.7e-2 (MLP), 4.1e-2 (CNN)  0 (MLP), <= 3.6e-7 (CNN)
#
# The eager route runs each member through the reference's kernels:
# BF16_EAGER_RTOL sits between 1.5e-5 and a missed autocast's 1.7e-2. The
# vmap route's batched kernels round at other points (a batched linear adds
# its bias to the bfloat16 matmul in float32, the unbatched one in bfloat16)
# and Adam turns rounding noise in small gradients into full steps: a correct
# vmap member lands as far from its bf16 reference as one that skipped
# autocast, so no bound on that distance tells them apart, and
# BF16_VMAP_PARAM_RTOL (2.5x the worst measured) bounds the agreement only.
# What tells them apart is the distance from the fp32 reference: at least
# 1.5e-3 for a bf16 member, at most 3.6e-7 for one that trained in float32;
# BF16_MIN_FROM_FP32 sits between. (A missed autocast in evaluation alone is
# the autocast spy's, below.) val_loss: vmap up to 7.3e-4 from its bf16 reference.
BF16_EAGER_RTOL = 1e-3
BF16_VMAP_PARAM_RTOL = 1e-1
BF16_VMAP_LOSS_RTOL = 5e-3
BF16_MIN_FROM_FP32 = 1e-4

BF16_CASES = {
    "mlp_sgd": (mlp, False, "sgd", [dict(lr=0.05, seed=0), dict(lr=0.1, momentum=0.9, seed=1), dict(lr=0.02, seed=2)]),
    "cnn_adam": (cnn, True, "adam", [dict(lr=1e-3, seed=0), dict(lr=3e-3, seed=1), dict(lr=2e-3, seed=2)]),
}


@pytest.mark.parametrize("case, route", [(case, route) for case in sorted(BF16_CASES)
                                         for route in ("eager", "vmap", "batched")
                                         if route != "batched" or case.startswith("mlp")])
def test_bf16_members_follow_their_bf16_reference(case, route):
    factory, images, family, configs = BF16_CASES[case]
    task = ct.Task(factory, digits(images=images), optimizer=family, batch_size=32, iteration_steps=10,
                   precision="bf16")
    if route == "eager":
        run_and_compare(task, configs, iterations=2, rtol=BF16_EAGER_RTOL, route="eager")
        return
    # The batched route's matmuls round as vmap's do (one batched kernel per layer).
    bucket = ct.Bucket(task, capacity=len(configs), route=route)
    slots = [bucket.add(c) for c in configs]
    fused = [bucket.run_iteration() for _ in range(2)]
    assert {m["route"] for results in fused for m in results.values()} == {route}
    fp32 = ct.Task(factory, digits(images=images), optimizer=family, batch_size=32, iteration_steps=10)
    for slot, config in zip(slots, configs):
        history, model = reference.train(task, config, iterations=2)
        for ours, theirs in zip(fused, history):
            assert math.isclose(ours[slot]["val_loss"], theirs["val_loss"], rel_tol=BF16_VMAP_LOSS_RTOL)
        params_close(bucket.export_model(slot), model, BF16_VMAP_PARAM_RTOL)
        _, fp32_model = reference.train(fp32, config, iterations=2)
        apart = params_close(bucket.export_model(slot), fp32_model, math.inf)
        assert apart >= BF16_MIN_FROM_FP32, f"slot {slot} is {apart:.3g} from its float32 reference: no autocast?"


# An lr error of a few percent hides inside BF16_VMAP_PARAM_RTOL: the vmap
# route's rounding moves a CNN Adam member as far as that. What it does not do
# is move a member nearer another lr's trajectory. Members of one seed, lrs 5%
# apart, after 2 iterations (measured, CPU, params_close's measure): each
# member 0.67e-2..2.3e-2 from its own bf16 reference, 3.2e-2..7.1e-2 from a
# bucket-mate's. With Adam's step 4% too large (a planted bug), members landed
# 0.4e-2..0.8e-2 from the next lr's reference, nearer than to their own.
BF16_LR_MATES = [dict(lr=2e-3, seed=0), dict(lr=2.1e-3, seed=0), dict(lr=1.9e-3, seed=0)]


def test_bf16_vmap_members_of_one_seed_are_each_nearer_their_own_bf16_reference_than_a_bucket_mates():
    task = ct.Task(cnn, digits(images=True), optimizer="adam", batch_size=32, iteration_steps=10, precision="bf16")
    bucket = ct.Bucket(task, capacity=len(BF16_LR_MATES), route="vmap")
    slots = [bucket.add(c) for c in BF16_LR_MATES]
    for _ in range(2):
        assert {m["route"] for m in bucket.run_iteration().values()} == {"vmap"}
    references = [reference.train(task, c, iterations=2)[1] for c in BF16_LR_MATES]
    for slot, own in zip(slots, references):
        apart = [params_close(bucket.export_model(slot), r, math.inf) for r in references]
        mates = [a for r, a in zip(references, apart) if r is not own]
        assert apart[references.index(own)] < min(mates), \
            f"slot {slot} (lr={bucket.config(slot)['lr']}) is nearer a bucket-mate's reference: {apart}"


class AutocastSpy(nn.Module):
    """A CNN with BatchNorm that records whether autocast is on in its forward."""

    seen: list[tuple[bool, bool]] = []  # (training, autocast on), one per forward

    def __init__(self):
        super().__init__()
        self.inner = SmallCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        AutocastSpy.seen.append((self.training, torch.is_autocast_enabled("cpu")))
        return self.inner(x)


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_bf16_autocasts_training_and_evaluation_and_keeps_batchnorm_statistics_float32_per_member(route):
    task = ct.Task(lambda c: AutocastSpy(), digits(images=True), optimizer="sgd", batch_size=32,
                   iteration_steps=5, precision="bf16")
    bucket = ct.Bucket(task, capacity=2, route=route)
    slots = [bucket.add(dict(lr=0.05, momentum=0.9, seed=s)) for s in (3, 4)]
    AutocastSpy.seen.clear()
    bucket.run_iteration()
    assert {training for training, _ in AutocastSpy.seen} == {True, False}  # training and evaluation both ran
    assert all(on for _, on in AutocastSpy.seen)
    assert all(t.dtype == torch.float32 for t in bucket.stack.state_tensors() if t.is_floating_point())
    stats = [bucket.export_model(k).inner.bn for k in slots]
    # chorus-torch documents BatchNorm statistics frozen at mean 0 / var 1 under
    # vmap + autocast (the update went to a cast copy). Here each member's move,
    # each its own, and as its reference's do.
    for bn in stats:
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.num_batches_tracked.item() == 5
    assert not torch.allclose(stats[0].running_mean, stats[1].running_mean)
    for slot, bn in zip(slots, stats):
        _, model = reference.train(task, bucket.config(slot), iterations=1)
        rtol = BF16_EAGER_RTOL if route == "eager" else BF16_VMAP_PARAM_RTOL
        for name in ("running_mean", "running_var"):
            ours, theirs = getattr(bn, name).double(), getattr(model.inner.bn, name).double()
            assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= rtol, name


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16'\); got 'fp16'"):
        ct.Task(mlp, digits(), precision="fp16")


# ----- class-probability targets (soft labels) ------------------------------------------------------
def soft_label_task(eval_batch_size: int = 1024, n_val: int = 256) -> ct.Task:
    """Digits with soft labels: each target a distribution over the 10 classes,
    peaked on the true class (what F.cross_entropy takes as probabilities)."""
    (x, y), (xv, yv) = digits(n_val=n_val)
    generator = torch.Generator().manual_seed(0)

    def soften(labels: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(len(labels), 10, generator=generator)
        return torch.softmax(noise + 4 * nn.functional.one_hot(labels, 10), dim=1)

    return ct.Task(mlp, ((x, soften(y)), (xv, soften(yv))), batch_size=32, iteration_steps=10,
                   eval_batch_size=eval_batch_size)


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_soft_label_members_follow_their_reference(route):
    configs = [dict(lr=0.1, seed=0), dict(lr=0.05, momentum=0.9, seed=1), dict(lr=0.1, label_smoothing=0.1, seed=2)]
    bucket, fused = run_and_compare(soft_label_task(), configs, iterations=3, rtol=MLP_RTOL, route=route)
    for slot, config in enumerate(configs):
        history, _ = reference.train(soft_label_task(), config, iterations=3)
        assert fused[-1][slot]["val_accuracy"] == pytest.approx(history[-1]["val_accuracy"], abs=1e-6)
    assert fused[-1][0]["val_accuracy"] > 0.2  # chance is 0.1: the argmax of each target is its true class


@pytest.mark.parametrize("route", ["vmap", "eager"])
def test_soft_label_accuracy_is_right_where_the_eval_batch_equals_the_class_count(route):
    # 10 rows against 10 classes, in every batch of the 250: comparing argmax
    # (10,) with the (10, 10) targets broadcast to (10, 10) instead of
    # raising, and counted nonsense.
    task = soft_label_task(eval_batch_size=10, n_val=250)
    bucket = ct.Bucket(task, capacity=1, route=route)
    bucket.add(dict(lr=0.1, seed=0))
    fused = bucket.run_iteration()[0]
    (xv, soft), model = task.load_data()[1].tensors, bucket.export_model(0)
    with torch.no_grad():
        expected = (model(xv).argmax(dim=1) == soft.argmax(dim=1)).float().mean().item()
    assert fused["val_accuracy"] == pytest.approx(expected, abs=1e-6)
