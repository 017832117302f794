"""Which loaded data a sweep's processes share through Ray's object store (Ray-free; docs/design.md D2).

A task whose ``data`` is a callable runs it in every process that trains:
each bucket and each solo trial. Measured on synth-solo (sklearn's
``make_classification``): 1.05 s in each of 8 solo processes, where plain
Tune's side builds it once. So the first process that loads it offers a copy
(actors/shared_data.py) and later ones fetch that instead. Only data that
travels as it is:

- a callable's: data given as tensors travels inside the task already;
- tensor splits, every tensor on the CPU: data a callable made on a GPU
  stays in the process (and on the device) that made it, and any other
  ``Dataset`` (a loader's, which may hold file handles or workers) loads in
  each process as before.

Where the pool loads it itself, ahead of the buckets (:func:`pool_preloads`):
on a cluster without GPUs. There every process that trains would load it on
the CPU anyway; on a GPU cluster a callable may make its data on the
device that trains it, which a copy made on the pool's CPU would bypass.
"""
from __future__ import annotations

from typing import Any, Mapping


def may_share(data: Any, loaded: tuple) -> bool:
    """Whether ``loaded`` (a task's ``load_data()``, from its ``data``) is offered to the sweep's other processes."""
    return callable(data) and all(_on_cpu_tensors(split) for split in loaded)


def _on_cpu_tensors(split: Any) -> bool:
    # A TensorSplit, duck-typed: this module imports no torch.
    tensors = getattr(split, "tensors", None)
    return isinstance(tensors, tuple) and bool(tensors) and all(
        getattr(getattr(t, "device", None), "type", None) == "cpu" for t in tensors)


def pool_preloads(cluster: Mapping[str, float]) -> bool:
    """Whether the pool loads a task's data as it learns the task (see the module)."""
    return cluster.get("GPU", 0) <= 0
