"""Models and data shared by the benchmarks (importable by Ray workers by value)."""
from __future__ import annotations

import sys

import torch
from torch import nn

from chorus_tune.examples_data import digits_split


def mlp(width: int, features: int = 64, classes: int = 10):
    def build(config: dict) -> nn.Module:
        return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, classes))
    build.__qualname__ = f"mlp{width}"
    return build


def small_cnn(channels: int = 1, size: int = 8, classes: int = 10):
    """Two conv blocks with BatchNorm (no conv bias before BatchNorm)."""
    def build(config: dict) -> nn.Module:
        c1, c2 = config.get("channels1", 8), config.get("channels2", 16)
        return nn.Sequential(
            nn.Conv2d(channels, c1, 3, padding=1, bias=False), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(c2 * (size // 4) ** 2, classes),
        )
    build.__qualname__ = f"cnn{size}"
    return build


def synthetic_classification(n_train: int = 16_000, n_val: int = 4_000, features: int = 64, classes: int = 10):
    """sklearn's make_classification: an epoch costs real compute, as in real sweeps."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=n_train + n_val, n_features=features, n_informative=features // 2,
                               n_redundant=features // 4, n_classes=classes, n_clusters_per_class=2,
                               class_sep=1.5, random_state=0)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def synthetic_images(n_train: int = 10_000, n_val: int = 2_000, channels: int = 3, size: int = 32,
                     classes: int = 10):
    """CIFAR-sized random images whose class shifts a per-class pattern: learnable, no download."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(classes, channels, size, size, generator=g)
    y = torch.randint(0, classes, (n_train + n_val,), generator=g)
    x = 0.5 * patterns[y] + torch.randn(n_train + n_val, channels, size, size, generator=g)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def synthetic_images_8x8():
    """The synthetic classification set, each row of 64 features seen as a 1x8x8 image (for the CNN)."""
    (x, y), (xv, yv) = synthetic_classification()
    return (x.reshape(-1, 1, 8, 8), y), (xv.reshape(-1, 1, 8, 8), yv)


def digits_images():
    (x, y), (xv, yv) = digits_split()
    return (x.reshape(-1, 1, 8, 8), y), (xv.reshape(-1, 1, 8, 8), yv)


WORKLOADS = {
    # name: (model factory, data factory)
    "digits-mlp64": (lambda: mlp(64), digits_split),
    "digits-mlp256": (lambda: mlp(256), digits_split),
    "digits-cnn": (lambda: small_cnn(1, 8), digits_images),
    "synth-mlp64": (lambda: mlp(64), synthetic_classification),
    "synth-mlp256": (lambda: mlp(256), synthetic_classification),
    "synth-cnn": (lambda: small_cnn(1, 8), synthetic_images_8x8),
    "cifar-cnn": (lambda: small_cnn(3, 32), synthetic_images),
}

try:  # Ray workers cannot import benchmarks/: ship this module by value.
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except ImportError:  # the core benchmarks run without Ray
    pass
