"""A task's data, loaded once per sweep and shared through Ray's object store
(docs/design.md D2; which data, and when the pool loads it: rules/shared_data.py).

Two ways a copy reaches the pool's :class:`DataCopies`:

- on a machine without GPUs, the pool loads it itself as it learns the task
  (in a thread: it has the task and torch already), while the first bucket
  processes start: measured on the 32-trial FIFO sweep (2 cores), a bucket
  process took 4.3 s from the pool's call to its ``__init__`` and then 1.7 s
  loading the data, each of the two buckets the same data at once;
- otherwise, the first process that loads it offers it (:func:`load_task_data`).

Copies are kept per node: a process fetches only a copy made on its own
node (on a cluster, each node loads its own, as a data callable that reads
node-local files expects, and nothing crosses the network). The pool keeps
each copy as an object of its own: an object lives only as
long as the process that put it (a solo trial's ends with its trial; Ray
2.56 removed ``ray.put(_owner=)``). A process asks the pool first (waiting for
a load in progress) and fetches the copy. Every call to the pool or the store
is bounded: a process that cannot reach either loads the data itself, as it
did before sharing, and a data callable that raises raises again where the
core first reads the data (the member's error, as before sharing).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import ray

from chorus_tune.tune.rules.shared_data import may_share

logger = logging.getLogger(__name__)

# Bounds the ask (which waits for the pool's own load in progress) and the fetch.
ASK_TIMEOUT_S = 60.0
FETCH_TIMEOUT_S = 60.0


def load_task_data(task: Any, task_id: str, pool: Any) -> None:
    """Fill ``task``'s data (``task.load_data()``'s cache) from the sweep's
    shared copy, or load it here and offer it to ``pool`` for the next process."""
    if pool is None or not callable(task.data) or task._loaded is not None:
        return
    node = ray.get_runtime_context().get_node_id()
    try:
        refs = _wait(pool.shared_data.remote(task_id, node), ASK_TIMEOUT_S)
        if refs:
            task._loaded = _wait(refs[0], FETCH_TIMEOUT_S)
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
        _wait(pool.offer_data.remote(task_id, node, [ray.put(loaded)]), FETCH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the next process loads its own
        logger.info("task %s: its data could not be offered to the sweep (%s)", task_id, exc)


def _wait(ref: Any, timeout_s: float) -> Any:
    """``ref``'s value, waiting at most ``timeout_s``. Through the ref's future
    rather than ``ray.get``: a bucket is an async actor, and Ray logs a
    "blocking ray.get inside async actor" warning for any ``ray.get`` in one,
    from any thread (this wait is in its ``__init__``, where nothing else runs)."""
    return ref.future().result(timeout=timeout_s)


def _load(task_blob: bytes) -> tuple[Any, Any]:
    """In a thread of the pool: the task's data from a copy of the task of its
    own (the pool's task keeps no data), as ``(ref or None, first input row)``:
    the row prices padding (``Task.input_row``), which would load the data again."""
    import ray.cloudpickle as cloudpickle

    task = cloudpickle.loads(task_blob)
    loaded = task.load_data()
    return (ray.put(loaded) if may_share(task.data, loaded) else None), task.input_row()


class DataCopies:
    """The pool's copies of its tasks' loaded data: ``(task id, node id) -> [ref]``
    (its own loads are kept under its own node)."""

    def __init__(self) -> None:
        self._refs: dict[str, list] = {}
        self._loading: dict[str, asyncio.Future] = {}
        # task id -> the load in this process (a thread's future, which the event
        # loop's own code may wait on: Seating keys members synchronously).
        self._loads: dict[str, concurrent.futures.Future] = {}
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    def preload(self, task_id: str, task: Any, task_blob: bytes) -> None:
        """Load the task's data in a thread of this process, unless it is loaded or loading."""
        key = (task_id, ray.get_runtime_context().get_node_id())
        if key in self._refs or key in self._loading or not callable(task.data):
            return
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="chorus-data")
        job = self._threads.submit(_load, task_blob)
        self._loads[task_id] = job
        loading = asyncio.wrap_future(job)
        self._loading[key] = loading
        loading.add_done_callback(lambda done: self._loaded(key, done))

    def _loaded(self, key: tuple, done: asyncio.Future) -> None:
        self._loading.pop(key, None)
        if done.cancelled():
            return
        if done.exception() is not None:
            # The processes load it themselves; the error reaches the member there.
            logger.info("task %s: the pool could not load its data (%s)", key[0], done.exception())
        elif done.result()[0] is not None:
            self._refs.setdefault(key, [done.result()[0]])

    def input_row(self, task_id: str) -> Any:
        """The first input row of the task's data this process loaded (waiting
        for its load in progress), or ``None`` where it loads none or its load
        failed. Blocks: for the event loop's synchronous code, which would
        otherwise load the data a second time (measured on the 4-width sweep's
        16k rows, 2 cores: the pool's first seat answered 3.8 s after ``fit()``,
        its two loads side by side beside the run's start)."""
        job = self._loads.get(task_id)
        if job is None:
            return None
        try:
            return job.result()[1]
        except Exception:  # noqa: BLE001 - said where the load ended (_loaded); the caller loads it
            return None

    async def input_row_when_loaded(self, task_id: str) -> Any:
        """:meth:`input_row`, without blocking the event loop."""
        job = self._loads.get(task_id)
        if job is not None:
            await asyncio.wait([asyncio.wrap_future(job)])
        return self.input_row(task_id)

    async def get(self, task_id: str, node: str) -> list:
        """``[ref]`` of the task's data made on ``node``, waiting for a load in
        progress there; ``[]`` if there is none."""
        loading = self._loading.get((task_id, node))
        if loading is not None:
            await asyncio.wait([loading])
        return list(self._refs.get((task_id, node), ()))

    async def offer(self, task_id: str, node: str, refs: list) -> None:
        """Keep a copy of ``refs[0]`` (a process's object, on ``node``) as this
        process's own; the first copy per node is kept."""
        key = (task_id, node)
        if key in self._refs:
            return
        value = await refs[0]
        if key not in self._refs:
            # Off the event loop: a put copies the whole data set.
            own = await asyncio.get_running_loop().run_in_executor(None, ray.put, value)
            self._refs[key] = [own]
