"""How many members fit: the capacity fit over real fused steps (docs/design.md D13).

The memory primitives it reads (meters, the out-of-memory test) are
:mod:`chorus_tune.memory`'s.

A bucket's peak memory grows linearly in its member count K: every member adds
its parameters, gradients, optimizer state and activations, and the rest (the
data on the device, the CUDA context's workspaces) is paid once. So
:func:`fit_capacity` runs real fused steps at a few small K, fits
``peak(K) = a + b*K`` by least squares, and takes the largest K whose
predicted peak stays under ``fraction`` of the free device memory (the margin
covers what ``max_memory_allocated`` does not see: the caching allocator's
fragmentation and rounding). :func:`auto_capacity` is the one call the Tune
layer needs.

**CPU-only devices get a fixed default**, :data:`CPU_DEFAULT_CAPACITY` (16, the
Tune layer's default ``bucket_size``), not a fit, because there is nothing
sound to fit. torch's CPU allocator keeps no peak statistics; the process's
peak resident size (``VmHWM``) counts the interpreter, the loaded data and
every earlier allocation, glibc keeps freed blocks rather than returning them,
and on a CPU machine the memory is shared with the data loader, Ray and the
other trial processes, so a per-step peak read from it is noise the fit would
extrapolate. And on a CPU the limit that matters is compute, not memory: a
fused step's time grows about linearly in K there (no idle parallel units to
fill), so a larger K lengthens every iteration without raising throughput,
while the host memory of K copies of a small model's state is rarely short.
An injected ``meter`` still makes :func:`auto_capacity` fit on a CPU.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.utils.data import Dataset

from .bucket import Bucket
from .memory import GIB, CudaMeter, MemoryMeter, is_out_of_memory
from .task import Task, TensorSplit

CPU_DEFAULT_CAPACITY = 16
DEFAULT_KS = (1, 2, 4)

# ----- the fit ------------------------------------------------------------------------------------
class CapacityFitError(ValueError):
    """The measurements cannot give a capacity (memory that does not grow with K,
    or not even one member fits)."""


@dataclass(frozen=True)
class CapacityFit:
    """The chosen bucket size and how it was reached.

    ``a`` and ``b`` (bytes, bytes per member) are the fitted line and
    ``points`` the measured ``(K, peak_bytes)``; ``a`` and ``b`` are ``None``
    when no fit was made (``source == "cpu-default"``, or fewer than two sizes
    measured: a cap of 1, or K=2 ran out). ``reason`` says what bounded ``k``.
    """

    k: int
    a: float | None
    b: float | None
    points: tuple[tuple[int, int], ...]
    free_bytes: int | None
    fraction: float
    source: str
    reason: str

    def predicted_peak(self, k: int) -> float:
        if self.a is None or self.b is None:
            raise ValueError(f"no fit was made ({self.source})")
        return self.a + self.b * k


def _least_squares(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    spread = sum((k - mean_k) ** 2 for k, _ in points)
    b = sum((k - mean_k) * (p - mean_p) for k, p in points) / spread
    return mean_p - b * mean_k, b


def fit_capacity(measure: Callable[[int], int], free_bytes: int | Callable[[], int], ks: Sequence[int] = DEFAULT_KS,
                 fraction: float = 0.8, cap: int | None = None) -> CapacityFit:
    """The largest K with ``a + b*K <= fraction * free_bytes``, from peaks ``measure(K)`` at ``ks``.

    ``measure(K)`` returns the peak bytes of a real fused iteration of K
    members; an out-of-memory error from it ends the measurements (that K, and
    every larger one, does not fit). ``free_bytes`` may be a callable, read
    after the measurements (so their memory is back). Ks above ``cap`` are not
    measured, and the result is at most ``cap``. The result is never below 1:
    a bucket of one is plain training. Raises :class:`CapacityFitError`
    when peaks do not grow with K (a meter reading the wrong device, or
    nothing) or when not even K=1 could run.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction}")
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be at least 1; got {cap}")
    ks = sorted(set(int(k) for k in ks))
    if len(ks) < 2 or ks[0] < 1:
        raise ValueError(f"ks must hold at least two distinct positive sizes; got {ks}")
    if cap is not None:
        ks = [k for k in ks if k <= cap] or [1]
    points: list[tuple[int, int]] = []
    ran_out_at = None
    for k in ks:
        ran_out = False
        try:
            points.append((k, int(measure(k))))
        except Exception as exc:  # noqa: BLE001 - only an allocation failure ends the measurements
            if not is_out_of_memory(exc):
                raise
            ran_out = True
        if ran_out:
            ran_out_at = k
            break
    free = int(free_bytes() if callable(free_bytes) else free_bytes)
    common = dict(free_bytes=free, fraction=fraction, source="measured", points=tuple(points))
    if not points:
        raise CapacityFitError(f"not even {ks[0]} member(s) fit: the measurement ran out of memory "
                               f"({free / GIB:.2f} GiB free)")
    if len(points) < 2:
        reason = (f"K={ran_out_at} ran out of memory while measuring" if ran_out_at is not None
                  else f"only K={points[0][0]} measured (cap {cap})")
        return CapacityFit(k=points[0][0], a=None, b=None, reason=reason, **common)
    a, b = _least_squares(points)
    if not b > 0:
        raise CapacityFitError(
            f"peak memory does not grow with the member count (slope {b:.3g} bytes per member from "
            f"{points}): the meter is not measuring the bucket's device")
    budget = fraction * free
    # + 1e-9: exact line data fits to 39.99999999 for 40; a billionth of a member is rounding, not memory.
    k = math.floor((budget - a) / b + 1e-9)
    reason = f"largest K with a + b*K <= {fraction:g} x free ({budget / GIB:.2f} GiB)"
    if ran_out_at is not None and k >= ran_out_at:
        k, reason = ran_out_at - 1, f"K={ran_out_at} ran out of memory while measuring"
    if cap is not None and k > cap:
        k, reason = cap, f"capped at {cap}"
    if k < 1:
        k, reason = 1, f"even K=1 is predicted over {fraction:g} x free; 1 is the floor (it is plain training)"
    return CapacityFit(k=k, a=a, b=b, reason=reason, **common)


# ----- measuring a real bucket --------------------------------------------------------------------
def _measuring_task(task: Task, steps: int) -> Task:
    # The same task, but an iteration of `steps` steps, not an epoch. The data
    # goes in as loaded, so a callable `data` is not called a second time.
    def given(split: TensorSplit | Dataset):
        return split.tensors if isinstance(split, TensorSplit) else split
    train, val = task.load_data()
    return dataclasses.replace(task, data=(given(train), given(val)), iteration_steps=steps)


def measure_peak(task: Task, config: dict, k: int, device: torch.device | str, meter: MemoryMeter,
                 steps: int = 2, route: str = "auto") -> int:
    """Peak bytes of a throwaway bucket of ``k`` members of ``config``: one
    iteration of ``steps`` fused steps and a full evaluation, after a warm-up
    iteration (the route probe and lazy allocations such as cuBLAS workspaces
    are not steady state). Counted from before the bucket is built, so its
    stacked tensors and its copy of the data are in the peak.

    Raises ``torch.OutOfMemoryError`` if the bucket had to split its members
    into smaller groups: its peak is then not the peak of ``k`` members.
    """
    measuring = _measuring_task(task, steps)
    meter.reset_peak()
    base = meter.peak_bytes()
    bucket = Bucket(measuring, k, device=device, route=route)
    for seed in range(k):
        bucket.add(dict(config, seed=seed))
    bucket.run_iteration()
    meter.reset_peak()
    bucket.run_iteration()
    peak = meter.peak_bytes() - base
    split = bucket.oom_recoveries
    del bucket
    if split:
        raise torch.OutOfMemoryError(f"{k} members ran out of memory while measuring (the bucket split them)")
    return peak


def auto_capacity(task: Task, config: dict, device: torch.device | str, fraction: float = 0.8,
                  cap: int | None = None, meter: MemoryMeter | None = None, ks: Sequence[int] = DEFAULT_KS,
                  steps: int = 2, route: str = "auto") -> CapacityFit:
    """The bucket size for members like ``config`` on ``device`` (``bucket_size="auto"``).

    On CUDA (or with an injected ``meter``), measured and fitted by
    :func:`fit_capacity` on throwaway buckets (see :func:`measure_peak`; pass
    the ``route`` the real bucket will use); on a CPU without a meter,
    :data:`CPU_DEFAULT_CAPACITY` (see the module docstring for why). At most
    ``cap`` either way.
    """
    device = torch.device(device)
    if meter is None and device.type == "cuda":
        meter = CudaMeter(device)
    if meter is None:
        k = CPU_DEFAULT_CAPACITY if cap is None else min(cap, CPU_DEFAULT_CAPACITY)
        return CapacityFit(k=k, a=None, b=None, points=(), free_bytes=None, fraction=fraction,
                           source="cpu-default", reason=f"fixed default on {device.type} (not measured)")
    def measure(k: int) -> int:
        return measure_peak(task, config, k, device, meter, steps=steps, route=route)

    return fit_capacity(measure, meter.free_bytes, ks=ks, fraction=fraction, cap=cap)
