"""The batched route (chorus_tune/batched.py, docs/design.md D8): which models it accepts,
why it refuses the others, and that the members it trains follow their references."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset

import chorus_tune as ct
from chorus_tune.batched import batched_forward, batched_linear
from chorus_tune.configuration import lift

import models
from models import Branching, SmallCNN, digits, mlp

RTOL = 1e-5


class Residual(nn.Module):
    """A custom module, as users write them: arithmetic between activations and
    with numbers, functions and methods, a GELU module."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.inner = nn.Linear(width, width)
        self.act = nn.GELU()
        self.head = nn.Linear(width, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + 0.5 * self.act(self.inner(h)).sigmoid()
        return self.head(h - 1.0)


class ScalesWhileTraining(nn.Module):
    """A forward that reads ``self.training``: a trace bakes in its mode."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.head(h * 0.5 if self.training else h)


def residual(config: dict) -> nn.Module:
    return Residual(config.get("width", 32))


class Flattening(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.view(x.size(0), -1))


class ReadsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return x @ self.fc.weight.t()


class Normalising(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x - x.mean(dim=0))  # a batch statistic: stacked, dim 0 would be the members


def test_a_sequential_mlp_is_accepted():
    assert batched_forward(mlp({})).eligible


def test_a_custom_module_of_linears_activations_and_arithmetic_is_accepted():
    assert batched_forward(Residual()).eligible


@pytest.mark.parametrize("model, named", [
    (Flattening(), ".size()"),
    (Branching(), "cannot trace"),
    (ReadsItsWeight(), "fc.weight"),
    (Normalising(), "mean"),
    (SmallCNN(), "Conv2d"),
    (nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10)), "LayerNorm"),
    (lift(nn.Sequential(nn.Linear(64, 32), nn.Dropout1d(0.2), nn.Linear(32, 10))), "Dropout1d"),
], ids=["flatten", "data_dependent_branch", "parameter_read_directly", "batch_mean", "convolution",
        "layernorm", "channel_dropout"])
def test_a_forward_that_may_mix_members_is_refused_naming_why(model, named):
    verdict = batched_forward(model)
    assert not verdict.eligible and named in verdict.why


def test_per_member_dropout_leaky_relu_and_elu_are_accepted_as_the_template_lifts_them():
    model = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.1), nn.Dropout(0.2), nn.Linear(32, 32), nn.ELU(),
                          nn.Linear(32, 10))
    assert batched_forward(lift(model)).eligible


def test_a_forward_hook_keeps_a_model_off_the_batched_route():
    model = mlp({})
    model[1].register_forward_hook(lambda module, args, out: out * 2)
    verdict = batched_forward(model)
    assert not verdict.eligible and "hook" in verdict.why


class Tied(nn.Module):
    """An autoencoder-like pair of Linears sharing one weight."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(64, 64, bias=False)
        self.dec = nn.Linear(64, 64, bias=False)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


def test_a_linear_whose_weight_is_not_its_own_is_refused():
    verdict = batched_forward(Tied())
    assert not verdict.eligible and "'dec'" in verdict.why and "tied" in verdict.why


def test_a_parametrized_linear_is_refused():
    model = mlp({})
    nn.utils.parametrizations.weight_norm(model[0])
    verdict = batched_forward(model)
    assert not verdict.eligible and "ParametrizedLinear" in verdict.why


def run_and_compare(task, configs, iterations):
    return models.run_and_compare(task, configs, iterations, RTOL, route="batched")


def _stacked_linear_case(bias: bool, extra_dims: tuple[int, ...] = ()):
    generator = torch.Generator().manual_seed(0)
    k, n, d_in, d_out = 3, 5, 7, 4
    x = torch.randn(k, *extra_dims, n, d_in, generator=generator, requires_grad=True)
    weight = torch.randn(k, d_out, d_in, generator=generator, requires_grad=True)
    b = torch.randn(k, d_out, generator=generator, requires_grad=True) if bias else None
    upstream = torch.randn(k, *extra_dims, n, d_out, generator=generator)
    return x, weight, b, upstream


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("extra_dims", [(), (2,)])
def test_the_stacked_linear_gives_each_member_its_own_linears_values_and_gradients(bias, extra_dims):
    # batched_linear writes its backward out (no transposed gradient to copy):
    # every member's output and all three gradients must be F.linear's.
    x, weight, b, upstream = _stacked_linear_case(bias, extra_dims)
    out = batched_linear(x, weight, b)
    (out * upstream).sum().backward()
    leaves = [x, weight] + ([b] if bias else [])
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    expected = torch.stack([torch.nn.functional.linear(x[i], weight[i], None if b is None else b[i])
                            for i in range(x.shape[0])])
    (expected * upstream).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for mine, reference in zip(got, [t.grad for t in leaves]):
        assert mine.shape == reference.shape
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)


class _CountsMatmuls(TorchDispatchMode):
    """Counts the batched matmuls run while it is active (backward included)."""

    def __init__(self):
        super().__init__()
        self.bmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.bmm += func is torch.ops.aten.bmm.default
        return func(*args, **(kwargs or {}))


def test_the_stacked_linear_computes_no_gradient_for_its_input_when_none_is_needed():
    # A first layer's input is the data: its backward is one matmul (the
    # weight's gradient), not two.
    x, weight, b, upstream = _stacked_linear_case(bias=True)
    loss = (batched_linear(x.detach(), weight, b) * upstream).sum()
    with _CountsMatmuls() as counts:
        loss.backward()
    assert counts.bmm == 1 and weight.grad is not None and b.grad is not None


def test_the_stacked_linear_trains_under_bf16_autocast():
    # Under autocast each op casts its own inputs: a backward written out would
    # meet a bf16 gradient beside the saved fp32 weight, so autograd runs it.
    x, weight, b, upstream = _stacked_linear_case(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = batched_linear(x, weight, b)
    (out.float() * upstream).sum().backward()
    assert weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_custom_module_members_on_the_batched_route_follow_their_reference(family):
    task = ct.Task(residual, digits(), optimizer=family, batch_size=32, iteration_steps=10)
    lrs = [0.05, 0.02, 0.1] if family == "sgd" else [1e-3, 3e-3, 2e-3]
    configs = [dict(lr=lr, momentum=0.9, weight_decay=1e-4 * i, seed=i) if family == "sgd" else
               dict(lr=lr, weight_decay=1e-3 * i, seed=i) for i, lr in enumerate(lrs)]
    run_and_compare(task, configs, iterations=3)


def test_a_forward_that_reads_its_mode_evaluates_in_eval_mode_on_the_batched_route():
    # val_loss is computed in eval mode: a forward traced in train mode only
    # would evaluate with the training-time scale.
    task = ct.Task(lambda c: ScalesWhileTraining(), digits(), optimizer="sgd", batch_size=32, iteration_steps=5)
    run_and_compare(task, [dict(lr=0.05, seed=1), dict(lr=0.1, seed=2)], iterations=2)


class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_batched_members_sharing_one_batch_from_a_dataset_follow_their_reference():
    # Not tensors: every member gets the same batch (one (N, ...) input for the stack).
    (x, y), (xv, yv) = digits()
    task = ct.Task(residual, (Pairs(x, y), Pairs(xv, yv)), optimizer="sgd", batch_size=32, iteration_steps=6)
    run_and_compare(task, [dict(lr=0.05, seed=1), dict(lr=0.1, momentum=0.9, seed=2)], iterations=2)


def test_label_smoothing_members_on_the_batched_route_follow_their_reference():
    task = ct.Task(mlp, digits(), optimizer="sgd", batch_size=32, iteration_steps=10)
    configs = [dict(lr=0.05, label_smoothing=0.1, seed=1), dict(lr=0.05, seed=2),
               dict(lr=0.1, label_smoothing=0.3, seed=3)]
    run_and_compare(task, configs, iterations=2)


def test_batched_asked_for_a_model_it_cannot_run_is_refused_saying_why():
    task = ct.Task(lambda c: Flattening(), digits(), optimizer="sgd", batch_size=32, iteration_steps=2)
    bucket = ct.Bucket(task, capacity=2, route="batched")
    with pytest.raises(ValueError, match=r"route='batched' cannot run Flattening: .*size"):
        bucket.add(dict(lr=0.1, seed=0))
    assert bucket.live_slots == []


def test_the_probe_times_the_batched_route_beside_vmap_for_a_model_it_accepts():
    task = ct.Task(mlp, digits(), optimizer="sgd", batch_size=32, iteration_steps=2)
    bucket = ct.Bucket(task, capacity=2)
    for seed in (1, 2):
        bucket.add(dict(lr=0.05, seed=seed))
    bucket.run_iteration()
    report = bucket.route_report()
    assert {"eager", "vmap", "batched"} <= set(report["seconds"]) and report["batched"]["eligible"]


def test_the_route_report_says_why_a_model_is_not_batched():
    task = ct.Task(lambda c: SmallCNN(), digits(images=True), optimizer="sgd", batch_size=32, iteration_steps=2)
    bucket = ct.Bucket(task, capacity=2)
    for seed in (1, 2):
        bucket.add(dict(lr=0.05, seed=seed))
    bucket.run_iteration()
    report = bucket.route_report()
    assert "batched" not in report["seconds"] and "Conv2d" in report["batched"]["why_not"]
