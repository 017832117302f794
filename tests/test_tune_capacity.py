"""How many members fit, through Tune: ``bucket_size="auto"`` and out-of-memory
errors inside a bucket's iteration (docs/design.md D13).

No GPU here: the memory is a fake device's. ``MemberMeter`` reads memory in use
as a fixed cost per member of every live ``Bucket`` in its process (the
measurement runs in a Ray task on the bucket's resources, so the meter travels
there). ``CostlyMLP`` runs out of memory, as a GPU would, when the members one
fused call trains cost more than ``ROOM`` together.
"""
from __future__ import annotations

import gc
import sys

import pytest
import ray
import ray.cloudpickle
import torch
from ray import tune
from torch import nn

from chorus_tune import reference
from chorus_tune.tune import ChorusTrainable, bucket_stats
from chorus_tune.tune.values import result_keys as rk

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

from tune_support import digits_task, mlp, run_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("local_ray")

MIB = 2**20
ROOM = 2.0  # the fake device's room, in member costs


class MemberMeter:
    """Bytes in use: ``per_member`` for each member of every live Bucket of
    this process; ``free`` bytes on the device when none is built."""

    def __init__(self, per_member: int, free: int):
        self.per_member, self.free = per_member, free

    def __call__(self, device) -> "MemberMeter":  # the memory_meter option: device -> meter
        return self

    def in_use(self) -> int:
        from chorus_tune.bucket import Bucket

        return self.per_member * sum(len(b.live_slots) for b in gc.get_objects() if isinstance(b, Bucket))

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return self.in_use()

    def free_bytes(self) -> int:
        return self.free - self.in_use()


class CostlyMLP(nn.Module):
    """``mlp(config)`` that costs ``config["cost"]`` (default 1) of the fake
    device's ``ROOM`` while it trains: a fused call of members whose costs sum
    past ``ROOM`` raises ``torch.OutOfMemoryError`` from the forward."""

    def __init__(self, config: dict):
        super().__init__()
        self.inner = mlp(config)
        self.register_buffer("cost", torch.tensor(float(config.get("cost", 1.0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and _group_cost(self.cost) > ROOM:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (fake)")
        return self.inner(x)


def _group_cost(cost: torch.Tensor) -> float:
    # Under vmap the buffer is batched over the members of the call: unwrap it.
    functorch = torch._C._functorch
    while functorch.is_batchedtensor(cost):
        cost = functorch.get_unwrapped(cost)
    return float(cost.sum())


def _costly(config: dict) -> nn.Module:
    return CostlyMLP(config)


def _fit(result) -> dict:
    return result.metrics[rk.CAPACITY_FIT]


def _follows_reference(task, result, iterations: int) -> None:
    config = {k: v for k, v in result.config.items()}
    expected, _ = reference.train(task, config, seed=result.metrics[rk.SEED], iterations=iterations)
    frame = result.metrics_dataframe.sort_values("training_iteration")
    assert frame["val_loss"].tolist() == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


def test_auto_bucket_size_on_a_cpu_is_the_capped_default_and_results_say_so(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size="auto", max_bucket_size=2, max_buckets=2)
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.05, 0.1, 0.2, 0.3])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"), run_config=run_config(tmp_path, 2),
    ).fit()
    assert not results.errors
    fits = [_fit(r) for r in results]
    assert {(f["k"], f["source"], f["a"]) for f in fits} == {(2, "cpu-default", None)}
    defaults = [s for s in bucket_stats().values() if (s["capacity_fit"] or {}).get("source") == "cpu-default"]
    assert len(defaults) >= 2 and {s["bucket_size"] for s in defaults} == {2}


def test_auto_bucket_size_with_a_meter_is_measured_where_buckets_run_and_used(tmp_path):
    task = digits_task()
    # 7 MiB a member, 20 MiB free: the largest K under 0.8 x 20 MiB is 2.
    meter = MemberMeter(per_member=7 * MIB, free=20 * MIB)
    trainable = ChorusTrainable.for_task(task, bucket_size="auto", memory_meter=meter, max_buckets=2)
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.05, 0.1, 0.2, 0.3])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"), run_config=run_config(tmp_path, 2),
    ).fit()
    assert not results.errors
    fit = _fit(results[0])
    assert fit["source"] == "measured" and fit["k"] == 2
    assert fit["b"] == pytest.approx(7 * MIB) and fit["a"] == pytest.approx(0, abs=1)
    # The pool outlives a run: earlier tests' buckets are in its stats too.
    measured = [s for s in bucket_stats().values() if (s["capacity_fit"] or {}).get("source") == "measured"]
    assert len(measured) >= 2 and {s["bucket_size"] for s in measured} == {2}
    _follows_reference(task, results[0], 2)


def test_out_of_memory_in_an_iteration_loses_nothing_through_tune(tmp_path):
    # Four members of cost 1 in a bucket of 4 on a device with room for 2:
    # every fused call of more than 2 runs out; the bucket trains them in
    # smaller groups and every trial still follows its reference.
    task = digits_task(model=_costly)
    trainable = ChorusTrainable.for_task(task, bucket_size=4, max_buckets=1, route="vmap")
    lrs = [0.05, 0.1, 0.2, 0.3]
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search(lrs)},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"), run_config=run_config(tmp_path, 2),
    ).fit()
    assert not results.errors and len(results) == len(lrs)
    assert max(r.metrics[rk.OOM_RECOVERIES] for r in results) >= 1  # it did run out
    for r in results:
        _follows_reference(task, r, 2)


def test_a_member_that_runs_out_of_memory_alone_fails_only_its_trial(tmp_path):
    task = digits_task(model=_costly)
    trainable = ChorusTrainable.for_task(task, bucket_size=4, max_buckets=1, route="vmap")
    # Costs 0.5 and 1.5 fit together; 3 fits nowhere, not even alone.
    results = tune.Tuner(
        trainable, param_space={"lr": 0.1, "cost": tune.grid_search([0.5, 1.5, ROOM + 1])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"), run_config=run_config(tmp_path, 2),
    ).fit()
    failed = [r for r in results if r.error is not None]
    assert [r.config["cost"] for r in failed] == [ROOM + 1]
    message = str(failed[0].error)
    assert "ran out of memory even trained alone" in message and "CostlyMLP" in message and "K=4" in message
    for r in results:
        if r.error is None:
            _follows_reference(task, r, 2)
