"""The PBT test's tight reference comparison is made where training is stable (Ray-free).

A fused member and its reference compute the same sums, but a route or a
kernel may add them in another order. On this project's AVX-512 machine every
route is bit-exact with the reference; where MKL picks AVX2 kernels, the vmap
route's batched matmul rounds otherwise, about 1e-7 of val_loss an iteration.
What that becomes depends on the training: with the ReLU MLP at lr 0.5 and
momentum 0.9 it passed 1e-5 in 4 iterations for 3 seeds in 400 (7e-2 for
one), and a PBT donor failed the Ray test at rel=1e-5 in a clean CI run.

These tests measure the growth with a noise of that size that every host
makes: the reference trained with each batch's rows in another order (the same
samples, so the same math, rounded otherwise at every step; over 400 seeds it
moved val_loss as the AVX2 vmap route did: median 3.4e-7 and 3.3e-7 at
iteration 4, 99th percentile 2.1e-6 and 2.3e-6). The full measurements
(hundreds of seeds per setting) are in tests/stable_settings.py.
"""
from __future__ import annotations

import pytest
import torch

from chorus_tune import Task, reference

from models import mlp, tanh_mlp
from stable_settings import PBT_ITERATIONS, PBT_LR, PBT_MOMENTUM, PBT_RESULT_TOL
from tune_support import digits_task

# Seeds where the ReLU MLP at lr 0.5 (942482346, 1720049734) or lr 0.2
# (654115297) let rounding noise pass 1e-5, and ordinary ones.
SENSITIVE = (942482346, 1720049734, 654115297)
ORDINARY = (0,)
REORDERINGS = (1, 2)


@pytest.fixture(autouse=True)
def one_thread():
    # The values are bit-exact at 1, 2 and 4 threads (measured); at 2 on this
    # busy 2-core machine a run took 0.9-1.5 CPU-s spinning in OpenMP, at 1 0.03.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _val_losses(task: Task, config: dict, seed: int, reorder: int | None) -> list[float]:
    """val_loss of iterations 1..PBT_ITERATIONS; with ``reorder``, each batch's rows in another order."""
    run = reference.ReferenceRun(task, config, seed)
    if reorder is not None:
        generator = torch.Generator().manual_seed(reorder)
        take = run.order.take

        def reordered(steps: int) -> torch.Tensor:
            rows = take(steps)
            order = torch.stack([torch.randperm(rows.shape[1], generator=generator) for _ in range(rows.shape[0])])
            return torch.gather(rows, 1, order)

        run.order.take = reordered
    return [run.run_iteration()["val_loss"] for _ in range(PBT_ITERATIONS)]


def _drift(task: Task, config: dict, seed: int, reorderings=REORDERINGS) -> float:
    """The largest relative change of any iteration's val_loss that reordering makes."""
    plain = _val_losses(task, config, seed, None)
    return max(abs(a - b) / abs(b) for r in reorderings for a, b in zip(_val_losses(task, config, seed, r), plain))


def test_the_pbt_sweeps_settings_keep_rounding_noise_ten_times_under_its_tolerance():
    task, config = digits_task(model=tanh_mlp), {"lr": PBT_LR, "momentum": PBT_MOMENTUM}
    drifts = {seed: _drift(task, config, seed) for seed in (*SENSITIVE, *ORDINARY)}
    assert max(drifts.values()) < PBT_RESULT_TOL / 10, drifts


def test_the_relu_mlp_at_lr_0_5_lets_rounding_noise_pass_the_tolerance():
    # The settings the PBT test had: the measurement above does see chaos. Which
    # reordering shows it on a seed depends on the host's kernels (on an AVX-512
    # host reordering 2 of the first seed gave 6.2e-5; on an AMD EPYC host it gave
    # 1.1e-6, and reordering 1 6.3e-5, the second seed 8.2e-5), so every
    # reordering of both ReLU seeds is measured and the largest must pass.
    task, config = digits_task(model=mlp), {"lr": 0.5, "momentum": 0.9}
    assert max(_drift(task, config, seed) for seed in SENSITIVE[:2]) > PBT_RESULT_TOL
