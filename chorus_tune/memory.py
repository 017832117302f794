"""Device memory primitives: is an error an allocation failure, give a failed
step's memory back, describe a device's memory, and meters of its peak.

Below both :mod:`chorus_tune.bucket` (which recovers from running out of
memory) and :mod:`chorus_tune.capacity` (which runs real buckets to fit how
many members fit), so neither imports the other's module to reach them.
"""
from __future__ import annotations

import gc
import os
from typing import Protocol

import torch

GIB = 2**30

# Errors that mean an allocation failed. cuBLAS and cuDNN report a failed
# workspace allocation as a plain RuntimeError with their status name in it, a
# kernel launch without memory as "CUDA error: out of memory", and torch's CPU
# allocator as "DefaultCPUAllocator: can't allocate memory: you tried to
# allocate N bytes".
_OOM_MARKERS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                "can't allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is an allocation failure.

    ``torch.OutOfMemoryError`` anywhere (the user's forward included), and the
    RuntimeErrors cuBLAS/cuDNN/CUDA and the CPU allocator raise when an
    allocation fails. Anything
    else is a real error and must not be retried in smaller groups.
    """
    seen = 0
    while exc is not None and seen < 8:  # follow `raise ... from oom`, not forever
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        if isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def release_memory(device: torch.device) -> None:
    """Give the memory of a failed step back to the device.

    Call it *after* the ``except`` block: inside it, the exception's traceback
    still holds the failed step's frames and every activation tensor in them,
    so emptying the cache there frees nothing. ``gc.collect`` breaks the cycles
    a traceback stored by library code can form.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("MemAvailable", "MemTotal")}
        return kib["MemAvailable"], kib["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def available_bytes(device: torch.device) -> int:
    """Bytes ``device`` could still give this process (host memory for a CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) + int(torch.cuda.memory_reserved(device)
                                                             - torch.cuda.memory_allocated(device))
    return host_memory()[0]


def check_capacity_fits(capacity: int, member_bytes: int, device: torch.device) -> None:
    """Refuse a bucket of ``capacity`` slots whose least memory, ``capacity x
    member_bytes`` (a lower bound: every slot is a row of every stacked tensor,
    and the vmap route computes every row), is more than ``device`` has
    available: it would fail only after minutes of allocation, or take the
    host down. Raises ``ValueError`` naming the capacity that would fit."""
    available = available_bytes(device)
    if capacity * member_bytes <= available:
        return
    fits = max(1, available // max(1, member_bytes))
    raise ValueError(
        f"capacity {capacity} needs at least {capacity * member_bytes / GIB:.2f} GiB on {device} for this model "
        f"({member_bytes / 2**20:.3f} MiB a slot: parameters, gradients, optimizer state, buffers and a batch), "
        f"more than is available ({describe_memory(device)}). Pass a capacity of at most {fits} (or "
        "chorus_tune.capacity.auto_capacity / bucket_size='auto' to size it from memory)")


def describe_memory(device: torch.device) -> str:
    """One line on the memory of ``device``, for error messages."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        return (f"{torch.cuda.get_device_name(device)}: {free / GIB:.2f} GiB free of {total / GIB:.2f} GiB, "
                f"{held / GIB:.2f} GiB allocated by this process")
    available, total = host_memory()
    return f"host memory: {available / GIB:.2f} GiB available of {total / GIB:.2f} GiB"


# ----- meters -------------------------------------------------------------------------------------
class MemoryMeter(Protocol):
    """What a capacity fit reads. Tests inject fakes; :class:`CudaMeter` is the real one."""

    def reset_peak(self) -> None:
        """Start a measurement: the high-water mark drops to the bytes in use now."""

    def peak_bytes(self) -> int:
        """The most bytes in use at once since :meth:`reset_peak`."""

    def free_bytes(self) -> int:
        """Bytes the device could still give this process."""


class CudaMeter:
    """Peak and free memory of one CUDA device, as torch's caching allocator sees it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def free_bytes(self) -> int:
        # Cached blocks are ours to reuse, but mem_get_info counts them as used.
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])
