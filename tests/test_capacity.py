"""The capacity fit: peak(K) = a + b*K from a few measured sizes, the largest K
under a fraction of free memory (docs/design.md D13). Meters are injected: no GPU here."""
from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import chorus_tune as ct
from chorus_tune import capacity
from chorus_tune.bucket import Bucket
from chorus_tune.capacity import CapacityFitError, auto_capacity, fit_capacity
from chorus_tune.memory import CudaMeter

from models import digits, mlp

MIB = 2**20
SMALL = digits(n_train=256, n_val=64)  # loaded once for the module (importing scikit-learn takes seconds)


def linear(a: float, b: float, calls: list[int] | None = None):
    def measure(k: int) -> int:
        if calls is not None:
            calls.append(k)
        return int(a + b * k)
    return measure


def test_linear_peaks_give_the_largest_k_under_the_fraction_of_free_memory():
    calls = []
    fit = fit_capacity(linear(100 * MIB, 10 * MIB, calls), free_bytes=1000 * MIB)
    assert calls == [1, 2, 4]
    assert fit.points == ((1, 110 * MIB), (2, 120 * MIB), (4, 140 * MIB))
    assert fit.a == pytest.approx(100 * MIB) and fit.b == pytest.approx(10 * MIB)
    assert fit.k == 70  # (0.8 * 1000 - 100) / 10
    budget = 0.8 * fit.free_bytes
    assert fit.predicted_peak(fit.k) == pytest.approx(budget) and fit.predicted_peak(fit.k + 1) > budget
    assert fit.source == "measured" and "0.8" in fit.reason


def test_the_fraction_is_honoured_and_its_boundary_is_inclusive():
    assert fit_capacity(linear(100, 10), free_bytes=1000, fraction=0.5).k == 40
    assert fit_capacity(linear(100, 10), free_bytes=1000, fraction=0.51).k == 41
    assert fit_capacity(linear(0, 8), free_bytes=80, fraction=1.0).k == 10


def test_the_cap_bounds_the_result_and_sizes_above_it_are_not_measured():
    calls = []
    fit = fit_capacity(linear(100, 10, calls), free_bytes=1000, cap=16)
    assert fit.k == 16 and "cap" in fit.reason and calls == [1, 2, 4]
    calls.clear()
    fit = fit_capacity(linear(100, 10, calls), free_bytes=1000, cap=3)
    assert fit.k == 3 and calls == [1, 2]
    calls.clear()
    fit = fit_capacity(linear(100, 10, calls), free_bytes=1000, cap=1)
    assert fit.k == 1 and calls == [1] and fit.b is None


def test_noisy_peaks_are_fitted_by_least_squares():
    ks, peaks = (1, 2, 4, 8), (1130, 1190, 1440, 1850)
    fit = fit_capacity(dict(zip(ks, peaks)).__getitem__, free_bytes=10_000, ks=ks, fraction=0.9)
    b, a = np.polyfit(ks, peaks, 1)
    assert fit.a == pytest.approx(a) and fit.b == pytest.approx(b)
    assert fit.k == int((9000 - a) // b)


@pytest.mark.parametrize("peaks", [(500, 500, 500), (500, 400, 300)])
def test_peaks_that_do_not_grow_with_k_are_a_clear_error(peaks):
    with pytest.raises(CapacityFitError, match="does not grow with the member count"):
        fit_capacity(dict(zip((1, 2, 4), peaks)).__getitem__, free_bytes=10_000)


def test_a_size_that_runs_out_while_measuring_bounds_the_result():
    def measure(k: int) -> int:
        if k >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 100 + 10 * k

    fit = fit_capacity(measure, free_bytes=10_000)  # the line alone would say 790
    assert fit.k == 3 and "K=4 ran out" in fit.reason and len(fit.points) == 2


def test_running_out_at_two_members_gives_one_and_at_one_is_an_error():
    def measure_upto(limit):
        def measure(k):
            if k > limit:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return 100 * k
        return measure

    fit = fit_capacity(measure_upto(1), free_bytes=10_000)
    assert fit.k == 1 and fit.b is None and "K=2 ran out" in fit.reason
    with pytest.raises(CapacityFitError, match="not even 1"):
        fit_capacity(measure_upto(0), free_bytes=10_000)


def test_other_errors_while_measuring_propagate():
    def measure(k):
        raise ValueError("a bug in the model")

    with pytest.raises(ValueError, match="a bug"):
        fit_capacity(measure, free_bytes=10_000)


def test_even_one_member_over_the_budget_still_gives_one():
    fit = fit_capacity(linear(900, 10), free_bytes=1000)
    assert fit.k == 1 and "even K=1" in fit.reason


def test_free_bytes_may_be_read_after_the_measurements():
    order = []
    fit = fit_capacity(lambda k: order.append(k) or 10 * k, free_bytes=lambda: order.append("free") or 100)
    assert order == [1, 2, 4, "free"] and fit.free_bytes == 100 and fit.k == 8


@pytest.mark.parametrize("kwargs", [dict(fraction=0), dict(fraction=1.5), dict(cap=0), dict(ks=(2,)),
                                    dict(ks=(0, 1))])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        fit_capacity(linear(1, 1), free_bytes=100, **kwargs)


# ----- auto_capacity: real throwaway buckets, an injected meter --------------------------------------
class MemberMeter:
    """Bytes in use = ``fixed`` + ``per_member`` x the members of every live
    Bucket; checks that a peak is read only after a reset."""

    def __init__(self, buckets: weakref.WeakSet, fixed: int, per_member: int, free: int):
        self.buckets, self.fixed, self.per_member, self.free = buckets, fixed, per_member, free
        self.events: list[str] = []

    def in_use(self) -> int:
        return self.fixed + self.per_member * sum(len(b.live_slots) for b in self.buckets)

    def reset_peak(self) -> None:
        self.events.append("reset")

    def peak_bytes(self) -> int:
        assert self.events and self.events[-1] == "reset", "a peak read without a reset before it"
        self.events.append("peak")
        return self.in_use()

    def free_bytes(self) -> int:
        self.events.append("free")
        return self.free - self.in_use() + self.fixed


@pytest.fixture
def buckets(monkeypatch):
    made = weakref.WeakSet()
    real_init = Bucket.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.add(self)

    monkeypatch.setattr(Bucket, "__init__", init)
    return made


def test_auto_capacity_measures_real_buckets_of_each_size(buckets):
    loads = []

    def data():
        loads.append(1)
        return SMALL

    task = ct.Task(mlp, data, batch_size=32)  # an iteration is an epoch: the measurement shortens it
    meter = MemberMeter(buckets, fixed=50 * MIB, per_member=7 * MIB, free=1000 * MIB)
    fit = auto_capacity(task, dict(lr=0.1), "cpu", meter=meter, route="vmap")
    assert [k for k, _ in fit.points] == [1, 2, 4]
    # Counted from before the bucket is built: its own tensors are in the peak, what was there before is not.
    assert fit.points == ((1, 7 * MIB), (2, 14 * MIB), (4, 28 * MIB))
    assert fit.k == int(0.8 * 1000 // 7) and fit.free_bytes == 1000 * MIB
    assert meter.events == ["reset", "peak", "reset", "peak"] * 3 + ["free"]
    assert len(loads) == 1  # the data was loaded once, not once per measurement
    assert not list(buckets)  # the throwaway buckets are gone


def test_a_measuring_bucket_that_had_to_split_counts_as_running_out(buckets, monkeypatch):
    real = Bucket.run_iteration

    def run_iteration(self, slots=None):
        out = real(self, slots)
        assert self.task.iteration_steps == 2
        if self.capacity >= 4:
            self.oom_recoveries += 1  # as if the group had been split
        return out

    monkeypatch.setattr(Bucket, "run_iteration", run_iteration)
    task = ct.Task(mlp, SMALL, batch_size=32, iteration_steps=50)
    meter = MemberMeter(buckets, fixed=0, per_member=MIB, free=1000 * MIB)
    fit = auto_capacity(task, dict(lr=0.1), "cpu", meter=meter, route="vmap")
    assert fit.k == 3 and "K=4 ran out" in fit.reason


def test_auto_capacity_on_a_cpu_without_a_meter_is_the_documented_default():
    task = ct.Task(mlp, SMALL)
    fit = auto_capacity(task, {}, "cpu")
    assert fit.k == capacity.CPU_DEFAULT_CAPACITY == 16 and fit.source == "cpu-default" and fit.points == ()
    assert auto_capacity(task, {}, "cpu", cap=4).k == 4


def test_cuda_meter_reads_torch_cuda_allocator_statistics(monkeypatch):
    calls = []
    fake = {
        "synchronize": lambda device=None: calls.append("sync"),
        "empty_cache": lambda: calls.append("empty"),
        "reset_peak_memory_stats": lambda device=None: calls.append("reset"),
        "max_memory_allocated": lambda device=None: 3 * MIB,
        "mem_get_info": lambda device=None: (5 * MIB, 8 * MIB),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    meter = CudaMeter("cuda:0")
    meter.reset_peak()
    assert calls == ["sync", "empty", "reset"]
    assert meter.peak_bytes() == 3 * MIB
    calls.clear()
    assert meter.free_bytes() == 5 * MIB and calls == ["empty"]  # cached blocks freed before reading
