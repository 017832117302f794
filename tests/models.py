"""Small models and data shared by the tests (digits: the copy chorus_tune ships, scikit-learn's set)."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

import chorus_tune as ct
from chorus_tune import reference


def digits(n_train: int = 1024, n_val: int = 256, images: bool = False):
    # The copy that ships in chorus_tune (test_packaging checks it is
    # scikit-learn's), not sklearn.datasets: importing scikit-learn took 2 s of
    # every bucket process's start, where these loaders run.
    from chorus_tune.examples_data import digits_arrays

    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    if images:
        x = x.reshape(-1, 1, 8, 8)
    y = torch.tensor(target, dtype=torch.long)
    return (x[:n_train], y[:n_train]), (x[n_train:n_train + n_val], y[n_train:n_train + n_val])


def mlp(config: dict) -> nn.Module:
    width = config.get("width", 32)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def tanh_mlp(config: dict) -> nn.Module:
    """``mlp`` with a smooth activation: no kink for rounding noise to cross (tests/stable_settings.py)."""
    width = config.get("width", 32)
    return nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 10))


class Branching(nn.Module):
    """A forward that branches on a value: vmap cannot run it (nor trace it), the eager route can."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        # No conv bias before BatchNorm (standard practice): its true gradient is zero,
        # so what it gets is rounding noise, which Adam would blow up to full steps.
        self.conv = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = nn.functional.max_pool2d(x, 2)
        return self.head(x.flatten(1))


def cnn(config: dict) -> nn.Module:
    return SmallCNN(config.get("channels", 4))


class MaybeResidual(nn.Module):
    """Same parameters whatever the config; the forward reads a per-instance flag
    kept where no module configuration looks (a dict: docs/design.md D9), so
    members differing in it share a bucket and only the route probe can tell."""

    def __init__(self, use_residual: bool):
        super().__init__()
        self.options = {"use_residual": use_residual}
        self.inner = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        if self.options["use_residual"]:
            h = h + x
        return self.head(h)


class PairDataset(Dataset):
    """A plain (non-tensor) Dataset that counts how often each sample is decoded."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y
        self.fetches = 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        self.fetches += 1
        return self.x[i], self.y[i]


def tiny_mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def tiny_task() -> ct.Task:
    """64 random rows of 4 features, 3 classes: member states small enough to read."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return ct.Task(tiny_mlp, ((x, y), (x[:16], y[:16])), optimizer="sgd", batch_size=16, iteration_steps=2)


def mlp_task(**kwargs) -> ct.Task:
    kwargs.setdefault("batch_size", 64)
    return ct.Task(mlp, digits(), **kwargs)


def regression_task(**kwargs) -> ct.Task:
    """Digits labels as real-valued targets, squared error."""
    (x, y), (xv, yv) = digits()
    kwargs.setdefault("batch_size", 32)
    return ct.Task(lambda c: nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1)),
                   ((x, y.float()), (xv, yv.float())), loss="mse", **kwargs)


def params_close(a: nn.Module, b: nn.Module, rtol: float) -> float:
    """Largest parameter/buffer difference relative to the tensor's scale; asserts the names match."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    worst = 0.0
    for name in sa:
        x, y = sa[name].double(), sb[name].double()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
    assert worst <= rtol, f"parameters differ by {worst:.3g} relative (bound {rtol})"
    return worst


# Each test pins the route it holds to the reference: under route="auto" the
# probe keeps whichever is faster, and a test could then pass on the eager loop
# alone. The compiled route is test_compile.py's (compiling takes 45-80 s a
# model on a 2-core CPU).
def run_and_compare(task, configs, iterations, rtol, route, **options):
    """Train ``configs`` in one bucket on ``route`` (``options``: the Bucket's
    others) and hold each member to ``reference.train``: the bucket and its results."""
    bucket = ct.Bucket(task, capacity=len(configs), route=route, **options)
    slots = [bucket.add(c) for c in configs]
    fused = [bucket.run_iteration() for _ in range(iterations)]
    assert bucket.route == route
    assert {m["route"] for results in fused for m in results.values()} == {route}
    for slot, config in zip(slots, configs):
        history, model = reference.train(task, config, iterations=iterations)
        for it in range(iterations):
            assert math.isclose(fused[it][slot]["val_loss"], history[it]["val_loss"], rel_tol=rtol, abs_tol=1e-7), (
                f"slot {slot} iteration {it + 1}: fused {fused[it][slot]['val_loss']} vs reference "
                f"{history[it]['val_loss']}")
        params_close(bucket.export_model(slot), model, rtol)
    return bucket, fused
