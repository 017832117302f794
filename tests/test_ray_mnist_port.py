"""The port of Ray's ``mnist_pytorch.py`` (benchmarks/ray_mnist.py) trains what the example trains.

Ray-free: the port's ``Task`` must take as many steps an iteration as the
example's ``train_func`` takes batches, and validate on as many images as its
``test_func`` reads, or the benchmark compares two different sweeps.
"""
from __future__ import annotations

import pathlib
import sys

import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ray_mnist  # noqa: E402  (benchmarks/ is not a package)


class _CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        _CountingSGD.steps += 1
        return super().step(closure)


def _loader(rows: int) -> torch.utils.data.DataLoader:
    x, y = torch.randn(rows, 1, 28, 28), torch.randint(0, 10, (rows,))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=ray_mnist.BATCH_SIZE)


def test_an_iteration_of_the_port_takes_as_many_steps_as_the_examples_train_func():
    model = ray_mnist.ConvNet()
    _CountingSGD.steps = 0
    ray_mnist.train_func(model, _CountingSGD(model.parameters(), lr=0.01), _loader(2_000))
    task = ray_mnist.ported_task()
    assert _CountingSGD.steps == task.steps_per_iteration({}) == 9
    assert task.batch_size_for({}) == ray_mnist.BATCH_SIZE


def test_the_port_validates_on_as_many_images_as_the_examples_test_func_reads():
    seen = []

    class Recording(ray_mnist.ConvNet):
        def forward(self, x):
            seen.append(len(x))
            return super().forward(x)

    ray_mnist.test_func(Recording(), _loader(2_000))
    _, (x_val, _) = ray_mnist.mnist_shaped()
    assert sum(seen) == len(x_val) == 320


def test_the_ported_convnet_learns_the_made_data():
    (x, y), _ = ray_mnist.mnist_shaped()
    assert x.shape[1:] == (1, 28, 28) and set(y.unique().tolist()) == set(range(10))
    torch.manual_seed(0)
    model = ray_mnist.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    for _ in range(6):
        ray_mnist.train_func(model, optimizer, loader)
    (_, _), (xv, yv) = ray_mnist.mnist_shaped()
    accuracy = (model(xv).argmax(1) == yv).float().mean().item()
    assert accuracy > 0.5  # chance is 0.1: the data carries its classes
