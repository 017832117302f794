"""A task's data, loaded once per sweep and shared through Ray's object store
(docs/design.md D2; which data: rules/shared_data.py).

The first process that loads a task's data offers it to the pool, which
keeps a copy as an object of its own: an object lives only as long as the
process that put it (a solo trial's ends with its trial; Ray 2.56 removed
``ray.put(_owner=)``). A later process asks the pool first and fetches the
copy.
Two processes that start together may both load: the pool keeps the first
copy offered. Every call to the pool or the store is bounded: a process that
cannot reach either loads the data itself, as it did before sharing, and
a data callable that raises raises again where the core first reads the
data (the member's error, as before sharing).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from chorus_tune.tune.rules.shared_data import may_share

logger = logging.getLogger(__name__)

# Bounds the ask and the fetch: a few ms each when the pool and the store answer.
ASK_TIMEOUT_S = 10.0
FETCH_TIMEOUT_S = 60.0


def load_task_data(task: Any, task_id: str, pool: Any) -> None:
    """Fill ``task``'s data (``task.load_data()``'s cache) from the sweep's
    shared copy, or load it here and offer it to ``pool`` for the next process."""
    if pool is None or not callable(task.data) or task._loaded is not None:
        return
    try:
        refs = ray.get(pool.shared_data.remote(task_id), timeout=ASK_TIMEOUT_S)
        if refs:
            task._loaded = ray.get(refs[0], timeout=FETCH_TIMEOUT_S)
            return
    except Exception as exc:  # noqa: BLE001 - a pool or store that fails costs a load here, nothing else
        logger.info("task %s: the shared copy of its data could not be read (%s); loading it here", task_id, exc)
    try:
        loaded = task.load_data()
    except Exception:  # noqa: BLE001 - raised again where the core first reads the data, as before sharing
        return
    if not may_share(task.data, loaded):
        return
    try:
        # Waited for: this process owns the object until the pool has copied it.
        ray.get(pool.offer_data.remote(task_id, [ray.put(loaded)]), timeout=FETCH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the next process loads its own
        logger.info("task %s: its data could not be offered to the sweep (%s)", task_id, exc)
