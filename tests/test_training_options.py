"""What Tune users tune for, fused and against the reference: per-member gradient
clipping (``max_grad_norm``), label smoothing (``label_smoothing``) and the
task's own metrics (``Task(metrics=...)``)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import chorus_tune as ct
from chorus_tune import optim, reference
from chorus_tune.bucket import MemberMetricError
from chorus_tune.optim import StackedOptimizer

from models import digits, mlp, params_close, regression_task

MLP_RTOL = 1e-5  # docs/design.md, 'What equivalent means'
ROUTES = ["vmap", "eager"]


def fused_and_reference(task, configs, iterations, route):
    """Every member's fused results, then each one's reference: asserts they match
    (val_loss, train_loss, every task metric, parameters); returns both."""
    bucket = ct.Bucket(task, capacity=len(configs), route=route)
    slots = [bucket.add(c) for c in configs]
    fused = [bucket.run_iteration() for _ in range(iterations)]
    assert {m["route"] for m in fused[-1].values()} == {route}
    references = []
    for slot, config in zip(slots, configs):
        history, model = reference.train(task, config, iterations=iterations)
        references.append(history)
        for it in range(iterations):
            for key in ("val_loss", "train_loss", *(task.metrics or {})):
                assert math.isclose(fused[it][slot][key], history[it][key], rel_tol=MLP_RTOL, abs_tol=1e-7), (
                    f"slot {slot} ({config}) iteration {it + 1} {key}: fused {fused[it][slot][key]} "
                    f"vs reference {history[it][key]}")
        params_close(bucket.export_model(slot), model, MLP_RTOL)
    return fused, references


# ----- max_grad_norm ---------------------------------------------------------------------------------

CLIP_CONFIGS = {
    # lr high enough that the gradients exceed the smaller norms for most steps
    "sgd": [dict(lr=0.5, max_grad_norm=0.1, seed=0), dict(lr=0.5, seed=1),
            dict(lr=0.3, momentum=0.9, weight_decay=1e-3, max_grad_norm=0.5, seed=2),
            dict(lr=0.5, max_grad_norm=1e6, seed=3)],
    "adam": [dict(lr=1e-2, max_grad_norm=0.05, seed=0), dict(lr=1e-2, seed=1),
             dict(lr=3e-3, weight_decay=1e-3, max_grad_norm=0.3, seed=2)],
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", sorted(CLIP_CONFIGS))
def test_members_with_different_max_grad_norms_or_none_follow_their_reference(family, route):
    task = ct.Task(mlp, digits(), optimizer=family, batch_size=32, iteration_steps=8)
    fused_and_reference(task, CLIP_CONFIGS[family], iterations=2, route=route)


def test_the_clipping_configs_do_clip():
    # Else the test above would pass with clipping ignored everywhere.
    task = ct.Task(mlp, digits(), optimizer="sgd", batch_size=32, iteration_steps=15)
    clipped, _ = reference.train(task, CLIP_CONFIGS["sgd"][0], iterations=1)
    unclipped, _ = reference.train(task, dict(CLIP_CONFIGS["sgd"][0], max_grad_norm=None), iterations=1)
    assert clipped[0]["val_loss"] != pytest.approx(unclipped[0]["val_loss"], rel=1e-3)


def test_stacked_clipping_is_clip_grad_norm_of_each_member():
    """Random gradients, two parameters, members with different norms, none, zero
    and a NaN member: each member's gradients are what clip_grad_norm_ makes them."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 4, 3, generator=g) * 3, torch.randn(5, 4, generator=g)]
    grads[0][4, 0, 0] = math.nan
    max_norms = [0.5, None, 100.0, 0.0, 1.0]
    stacked = [t.clone() for t in grads]
    limit = torch.tensor([math.inf if m is None else m for m in max_norms])
    optim.clip_grad_norms(stacked, limit, torch.isfinite(limit))
    for k, max_norm in enumerate(max_norms):
        params = [torch.nn.Parameter(torch.zeros_like(t[k])) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t[k].clone()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        for p, t in zip(params, stacked):
            torch.testing.assert_close(t[k], p.grad, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_a_member_without_max_grad_norm_is_untouched_bit_for_bit():
    opt = StackedOptimizer("sgd", {"w": torch.zeros(2, 3, requires_grad=True)})
    opt.set_member(0, optim.hyperparameters("sgd", {"lr": 0.0, "max_grad_norm": 0.1}))
    opt.set_member(1, optim.hyperparameters("sgd", {"lr": 0.0}))
    grad = torch.tensor([[1e3, 2e3, 3e3], [1e3, math.inf, 3e3]])
    opt.params["w"].grad = grad.clone()
    opt.step(torch.zeros(2), torch.ones(2, dtype=torch.bool), [0, 1])
    assert torch.equal(opt.params["w"].grad[1], grad[1])  # inf stays inf: not NaN from inf / inf
    assert torch.linalg.vector_norm(opt.params["w"].grad[0]).item() == pytest.approx(0.1, rel=1e-5)


@pytest.mark.parametrize("value", [-0.1, math.nan, "1.0", True])
def test_a_bad_max_grad_norm_is_refused_naming_the_key(value):
    bucket = ct.Bucket(ct.Task(mlp, digits()), capacity=2)
    with pytest.raises(ValueError, match="max_grad_norm must be a non-negative number"):
        bucket.add(dict(lr=0.1, max_grad_norm=value, seed=0))
    assert bucket.live_slots == []


# ----- label_smoothing -------------------------------------------------------------------------------

SMOOTHING_CONFIGS = [dict(lr=0.2, label_smoothing=0.1, seed=0), dict(lr=0.2, seed=1),
                     dict(lr=0.1, momentum=0.9, label_smoothing=0.3, seed=2), dict(lr=0.1, label_smoothing=0.0, seed=3)]


@pytest.mark.parametrize("route", ROUTES)
def test_members_with_different_label_smoothing_or_none_follow_their_reference(route):
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=8)
    fused_and_reference(task, SMOOTHING_CONFIGS, iterations=2, route=route)


def test_the_smoothing_configs_do_smooth():
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=15)
    smoothed, _ = reference.train(task, SMOOTHING_CONFIGS[0], iterations=1)
    plain, _ = reference.train(task, dict(SMOOTHING_CONFIGS[0], label_smoothing=None), iterations=1)
    # Else the test above would pass with smoothing ignored everywhere.
    assert smoothed[0]["val_loss"] != pytest.approx(plain[0]["val_loss"], rel=1e-3)


def test_smoothing_parts_mix_into_f_cross_entropy_with_label_smoothing():
    g = torch.Generator().manual_seed(0)
    output = torch.randn(7, 5, generator=g)
    target = torch.tensor([0, 4, 2, -100, 1, 1, 3])
    parts = ct.losses.smoothing_parts(ct.losses.cross_entropy)(output, target)
    for eps in (0.0, 0.1, 0.5, 0.9):
        expected = F.cross_entropy(output, target, reduction="none", label_smoothing=eps).mean()
        torch.testing.assert_close((1 - eps) * parts[0] + eps * parts[1], expected)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, "0.1"])
def test_label_smoothing_outside_zero_to_one_is_refused(value):
    bucket = ct.Bucket(ct.Task(mlp, digits()), capacity=2)
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\)"):
        bucket.add(dict(lr=0.1, label_smoothing=value, seed=0))
    assert bucket.live_slots == []


def test_label_smoothing_on_a_regression_loss_is_refused():
    bucket = ct.Bucket(regression_task(), capacity=2)
    with pytest.raises(ValueError, match="label_smoothing applies to loss='cross_entropy' only"):
        bucket.add(dict(lr=0.1, label_smoothing=0.1, seed=0))
    bucket.add(dict(lr=0.1, label_smoothing=0.0, seed=0))  # zero is no smoothing, on any loss


# ----- Task(metrics=...) ------------------------------------------------------------------------------

def macro_f1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Macro-averaged F1 over the classes present: not a mean of per-batch values."""
    predicted = outputs.argmax(dim=1)
    scores = []
    for c in targets.unique():
        tp = ((predicted == c) & (targets == c)).sum()
        precision = tp / (predicted == c).sum().clamp_min(1)
        recall = tp / (targets == c).sum()
        scores.append(0.0 if tp == 0 else float(2 * precision * recall / (precision + recall)))
    return sum(scores) / len(scores)


def median_abs_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.reshape(targets.shape) - targets).abs().median()


METRIC_CONFIGS = [dict(lr=0.05, seed=0), dict(lr=0.2, momentum=0.9, seed=1), dict(lr=0.01, seed=2)]


@pytest.mark.parametrize("route", ROUTES)
def test_task_metrics_on_the_whole_split_follow_the_reference(route):
    # Evaluation batches of 50 over 256 samples: a mean of per-batch F1 would differ.
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=10, eval_batch_size=50,
                   metrics={"val_f1": macro_f1})
    fused, _ = fused_and_reference(task, METRIC_CONFIGS, iterations=2, route=route)
    assert all("val_f1" in m and "val_accuracy" in m for m in fused[-1].values())


def test_a_metric_is_computed_on_the_whole_split_not_per_batch():
    # Else the test above could not tell the two apart.
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=10, eval_batch_size=50,
                   metrics={"val_f1": macro_f1})
    history, model = reference.train(task, METRIC_CONFIGS[0], iterations=1)
    _, (xv, yv) = digits()
    with torch.no_grad():
        per_batch = [macro_f1(model(xv[i:i + 50]), yv[i:i + 50]) for i in range(0, len(yv), 50)]
        whole = macro_f1(model(xv), yv)
    assert history[0]["val_f1"] == pytest.approx(whole, rel=1e-6)
    assert whole != pytest.approx(sum(per_batch) / len(per_batch), rel=1e-4)


@pytest.mark.parametrize("route", ROUTES)
def test_a_regression_metric_follows_the_reference(route):
    task = regression_task(iteration_steps=10, eval_batch_size=64, metrics={"val_medae": median_abs_error})
    fused_and_reference(task, [dict(lr=0.01, seed=0), dict(lr=0.02, max_grad_norm=0.5, seed=1)],
                        iterations=2, route=route)


def finite_only(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    if not torch.isfinite(outputs).all():
        raise ValueError("non-finite outputs")
    return float((outputs.argmax(1) == targets).float().mean())


@pytest.mark.parametrize("route", ROUTES)
def test_a_metric_that_raises_fails_only_that_member_with_its_message(route):
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=10, metrics={"strict": finite_only})
    bucket = ct.Bucket(task, capacity=3, route=route)
    configs = [dict(lr=0.1, seed=0), dict(lr=1e12, seed=1), dict(lr=0.05, seed=2)]  # slot 1 diverges
    for c in configs:
        bucket.add(c)
    with pytest.raises(MemberMetricError) as caught:
        bucket.run_iteration()
    error = caught.value
    assert error.slots == (1,) and set(error.results) == {0, 2}
    assert "metric 'strict' raised ValueError: non-finite outputs" in error.errors[1]
    assert "slot 1" in error.errors[1] and "seed 1" in error.errors[1]
    for slot in (0, 2):
        history, _ = reference.train(task, configs[slot], iterations=1)
        assert error.results[slot]["strict"] == pytest.approx(history[0]["strict"], rel=1e-6)
    bucket.retire(1)
    assert set(bucket.run_iteration()) == {0, 2}  # the others go on


def test_a_metric_returning_no_number_fails_the_member_saying_so():
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=2,
                   metrics={"per_class": lambda outputs, targets: outputs.mean(dim=0)})
    bucket = ct.Bucket(task, capacity=2)
    bucket.add(dict(lr=0.1, seed=0))
    with pytest.raises(MemberMetricError, match=r"metric 'per_class' must return one number; got a tensor of shape "
                                                r"\(10,\)"):
        bucket.run_iteration()


def test_a_torchmetrics_metric_object_gives_what_its_function_gives():
    torchmetrics = pytest.importorskip("torchmetrics")
    from torchmetrics.functional.classification import multiclass_f1_score

    f1 = torchmetrics.classification.MulticlassF1Score(num_classes=10, average="macro")
    task = ct.Task(mlp, digits(), batch_size=32, iteration_steps=10, eval_batch_size=50, metrics={"val_f1": f1})
    bucket = ct.Bucket(task, capacity=2)
    bucket.add(METRIC_CONFIGS[0])
    bucket.add(METRIC_CONFIGS[1])
    fused = bucket.run_iteration()
    _, (xv, yv) = digits()
    for slot in (0, 1):
        with torch.no_grad():
            expected = multiclass_f1_score(bucket.export_model(slot)(xv), yv, num_classes=10, average="macro")
        assert fused[slot]["val_f1"] == pytest.approx(float(expected), rel=1e-5)
    history, _ = reference.train(task, METRIC_CONFIGS[1], iterations=1)
    assert history[0]["val_f1"] == pytest.approx(fused[1]["val_f1"], rel=1e-5)  # no state left from member 0


def test_a_metric_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"Task.metrics\['f1'\] must be callable"):
        ct.Task(mlp, digits(), metrics={"f1": 0.5})


@pytest.mark.parametrize("name", ["val_loss", "val_accuracy", "training_iteration", "chorus/member", "done", ""])
def test_a_metric_name_clashing_with_a_result_key_is_refused(name):
    with pytest.raises((ValueError, TypeError), match="Task.metrics name"):
        ct.Task(mlp, digits(), metrics={name: macro_f1})
