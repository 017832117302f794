"""Models and data shared by the benchmarks (importable by Ray workers by value)."""
from __future__ import annotations

import math
import sys
import types

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


def mixed_mlp(features: int = 64, classes: int = 10):
    """Issue 19's model: a width and a dropout rate from the config, as users sweep
    module settings beside optimizer ones (``config["width"]``, ``config["dropout"]``)."""
    def build(config: dict) -> nn.Module:
        w = int(config["width"])
        return nn.Sequential(nn.Linear(features, w), nn.ReLU(), nn.Dropout(float(config["dropout"])),
                             nn.Linear(w, classes))
    build.__qualname__ = "mixed_mlp"
    return build


def mixed_space() -> dict:
    """Issue 19's search space, as a Tune user writes it: width {64, 128}, dropout
    U(0, 0.5), learning rate and weight decay log-uniform (SGD, momentum 0.9, seed 0
    as the grid sweeps have). Sampled with a fixed ``random_state`` on every side."""
    from ray import tune

    return {"width": tune.choice([64, 128]), "dropout": tune.uniform(0.0, 0.5),
            "lr": tune.loguniform(3e-3, 0.3), "weight_decay": tune.loguniform(1e-5, 1e-2),
            "momentum": 0.9, "seed": 0}


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
    # Issue 19's target: widths x dropout x lr x weight decay, on synth-mlp64's data.
    "synth-mixed": (mixed_mlp, synthetic_classification),
    # Issue 39's FIFO row: a custom nn.Module with two hidden layers of 64.
    "synth-mlp2h": (lambda: two_hidden_mlp, synthetic_classification),
    # Issue 41's FIFO width sweep: the same module at 4 widths (GRIDS below).
    "synth-widths": (lambda: two_hidden_mlp, synthetic_classification),
    # Issue 41's sweep where nothing can fuse: every trial its own batch size (GRIDS below).
    "synth-solo": (lambda: two_hidden_mlp, synthetic_classification),
}

# Workloads with a random search space of their own (name: () -> Tune param_space);
# the others sweep vs_tune.sweep()'s grid of learning rates x weight decays.
SPACES = {
    "synth-mixed": mixed_space,
    "tutorial-cnn": lambda: tutorial_space(),
}


def width_grid() -> dict:
    """Issue 41's FIFO width sweep, as a Tune user writes a grid: 4 hidden widths from 32
    to 256 x 2 learning rates x 4 weight decays = 32 trials (SGD, momentum 0.9, seed 0)."""
    from ray import tune

    return {"width": tune.grid_search([32, 64, 128, 256]), "lr": tune.grid_search([0.01, 0.1]),
            "weight_decay": tune.grid_search([0.0, 1e-4, 1e-3, 1e-2]), "momentum": 0.9, "seed": 0}


def solo_grid() -> dict:
    """Issue 41's sweep where nothing can fuse: 8 trials, each with a batch size of its
    own (batch size splits a bucket: members take different steps per epoch), so every
    trial trains in a one-member bucket. Two-hidden-layer MLP of 64, SGD, seed 0."""
    from ray import tune

    return {"batch_size": tune.grid_search([32, 40, 48, 56, 64, 80, 96, 128]), "lr": 0.05, "momentum": 0.9,
            "weight_decay": 1e-4, "seed": 0}


# Workloads whose sweep is a grid of their own (name: () -> Tune param_space with
# grid_search axes): one pass over it is the sweep, whatever --trials says.
GRIDS = {
    "synth-widths": width_grid,
    "tab-widths": width_grid,
    "synth-solo": solo_grid,
}


# ----- the GPU check's workloads (issue 10): data made where it is used -------------------------
# Their data callables build the sets on the process's own device (CUDA where the process
# sees a GPU, else the CPU): a bucket, or a plain-Tune trial process, makes its copy
# there, and no 600 MB of images travels through Ray. Sizes are bound in the closure
# (and in its qualified name, which is part of a bucket's structural key).

def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cifar_cnn3(classes: int = 10):
    """Three conv blocks with BatchNorm (no conv bias before BatchNorm) on 3x32x32;
    ``config["width"]`` (default 16) channels in the first block, doubling after."""
    def build(config: dict) -> nn.Module:
        w = int(config.get("width", 16))
        blocks = []
        for c_in, c_out in ((3, w), (w, 2 * w), (2 * w, 4 * w)):
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                       nn.MaxPool2d(2)]
        return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(4 * w * 4 * 4, classes))
    build.__qualname__ = "cifar_cnn3"
    return build


def mlp2(features: int = 64, classes: int = 10):
    """Two hidden layers; ``config["width"]`` (default 256) units each."""
    def build(config: dict) -> nn.Module:
        w = int(config.get("width", 256))
        return nn.Sequential(nn.Linear(features, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, classes))
    build.__qualname__ = "mlp2"
    return build


class TwoHiddenMLP(nn.Module):
    """A custom module, as a Tune user writes one: two hidden layers of ``width``
    units (issue 39's FIFO row; a module of the user's own class, not a Sequential)."""

    def __init__(self, features: int = 64, width: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(features, width)
        self.fc2 = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def two_hidden_mlp(config: dict) -> nn.Module:
    return TwoHiddenMLP(width=int(config.get("width", 64)))


def cifar_gratings(n_train: int = 50_000, n_val: int = 10_000, classes: int = 10, size: int = 32,
                   amplitude: float = 0.2):
    """CIFAR-sized (3x32x32) synthetic images: each class is a colour grating of its own
    orientation and frequency, at a random phase per image, under unit Gaussian noise.
    A random phase defeats a linear template; conv filters and pooling find it."""
    def load():
        device = _device()
        g = torch.Generator(device=device).manual_seed(0)
        n = n_train + n_val
        k = torch.arange(classes, device=device, dtype=torch.float32)
        angle = k * (math.pi / classes)
        freq = 2.0 + (k % 3)  # cycles across the image
        colour = torch.rand(classes, 3, generator=g, device=device) + 0.5
        y = torch.randint(0, classes, (n,), generator=g, device=device)
        phase = 2 * math.pi * torch.rand(n, 1, 1, generator=g, device=device)
        u = torch.arange(size, device=device, dtype=torch.float32) / size
        along = (torch.cos(angle)[:, None, None] * u[None, :, None]
                 + torch.sin(angle)[:, None, None] * u[None, None, :])  # (classes, size, size)
        wave = torch.cos(2 * math.pi * freq[y, None, None] * along[y] + phase)  # (n, size, size)
        x = amplitude * colour[y][:, :, None, None] * wave[:, None]
        x += torch.randn(n, 3, size, size, generator=g, device=device)
        return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    load.__qualname__ = f"cifar_gratings_{n_train}_{n_val}"
    return load


def tabular(n_train: int = 50_000, n_val: int = 10_000, features: int = 64, classes: int = 10,
            separation: float = 0.5):
    """A make_classification-like set in torch alone (the GPU machine has no sklearn):
    two clusters per class on the vertices of a hypercube in half the features,
    a quarter linear mixtures of those, a quarter noise."""
    def load():
        device = _device()
        g = torch.Generator(device=device).manual_seed(0)
        n, informative = n_train + n_val, features // 2
        centres = separation * torch.sign(torch.randn(2 * classes, informative, generator=g, device=device))
        y = torch.randint(0, classes, (n,), generator=g, device=device)
        cluster = 2 * y + torch.randint(0, 2, (n,), generator=g, device=device)
        inf = centres[cluster] + torch.randn(n, informative, generator=g, device=device)
        mix = torch.randn(informative, features // 4, generator=g, device=device) / math.sqrt(informative)
        rest = features - informative - features // 4
        x = torch.cat([inf, inf @ mix, torch.randn(n, rest, generator=g, device=device)], dim=1)
        return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    load.__qualname__ = f"tabular_{n_train}_{n_val}"
    return load


class TutorialNet(nn.Module):
    """The model of PyTorch's tutorial "Hyperparameter tuning with Ray Tune", as it
    writes it: two conv layers, then hidden layers of ``l1`` and ``l2`` units."""

    def __init__(self, l1: int = 120, l2: int = 84):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, l1)
        self.fc2 = nn.Linear(l1, l2)
        self.fc3 = nn.Linear(l2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def tutorial_net(config: dict) -> nn.Module:
    return TutorialNet(int(config["l1"]), int(config["l2"]))


def tutorial_space() -> dict:
    """The tutorial's search space: l1, l2 powers of two from 4 to 256, lr log-uniform,
    batch_size 2, 4, 8 or 16 (SGD, momentum 0.9 as the tutorial's; seed 0)."""
    from ray import tune

    return {"l1": tune.choice([2 ** i for i in range(2, 9)]), "l2": tune.choice([2 ** i for i in range(2, 9)]),
            "lr": tune.loguniform(1e-4, 1e-1), "batch_size": tune.choice([2, 4, 8, 16]),
            "momentum": 0.9, "seed": 0}


# name: (model factory, data factory taking (n_train, n_val)), defaults 50k/10k.
SIZED = {
    "cifar-cnn3": (cifar_cnn3, cifar_gratings),
    # Issue 41's tutorial-shaped sweep (SPACES); size it with --n-train/--n-val on a CPU.
    "tutorial-cnn": (lambda: tutorial_net, cifar_gratings),
    "tab-mlp2": (mlp2, tabular),
    # Issue 41's width sweep on the GPU machine (torch-only data; GRIDS below).
    "tab-widths": (lambda: two_hidden_mlp, tabular),
}
WORKLOADS.update({name: (model, data()) for name, (model, data) in SIZED.items()})


def process_cache() -> dict:
    """A dict that lives as long as the process: a plain-Tune trial process keeps its data
    here across the trials it serves (``reuse_actors=True``). In ``sys.modules``, because
    this module reaches Ray workers by value: its own globals are new with every unpickling."""
    module = sys.modules.get("_chorus_bench_cache")
    if module is None:
        module = sys.modules["_chorus_bench_cache"] = types.ModuleType("_chorus_bench_cache")
        module.data = {}
    return module.data


def workload(name: str, n_train: int | None = None, n_val: int | None = None):
    """(model builder, data callable) of a named workload; sizes apply to SIZED ones."""
    if name in SIZED:
        model, data = SIZED[name]
        sizes = {k: v for k, v in (("n_train", n_train), ("n_val", n_val)) if v is not None}
        return model(), data(**sizes)
    if n_train is not None or n_val is not None:
        raise ValueError(f"workload {name!r} has a fixed size; sized ones: {sorted(SIZED)}")
    model, data = WORKLOADS[name]
    return model(), data


try:  # Ray workers cannot import benchmarks/: ship this module by value.
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except ImportError:  # the core benchmarks run without Ray
    pass
