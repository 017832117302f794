"""Shared pieces of the cluster tests (docs/design.md D14): fake Ray clusters as Ray's own tests
build them (``ray.cluster_utils.Cluster``), a sweep, and its checks against ``reference.train``.

Each fake node is a raylet of its own on this machine, with the CPUs and GPUs
it declares. Ray enforces neither: a declared GPU needs no card. Ray still
assigns GPU ids per node and sets ``CUDA_VISIBLE_DEVICES`` in each bucket
actor; a bucket whose torch has no CUDA trains on the CPU and says so. All
nodes share this machine's disk, so Tune's ``storage_path`` is reachable from
every node, as a shared file system or an object store must be on a real one.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
from contextlib import contextmanager

import pytest
import ray
import ray.cloudpickle
from ray import tune
from ray.cluster_utils import Cluster

from chorus_tune import Task, reference
from chorus_tune.tune import ChorusSearch, ChorusTrainable, bucket_stats

from tune_support import by_iteration, digits, digits_task, mlp

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

# One shape for every cluster test (a module's tests share one cluster: a
# start costs about 12 CPU-s of every node's Ray processes and 8 s here). One
# GPU per worker: one bucket per worker, so a lost worker's trials must wait
# for the survivor's card (issue 20), and half the bucket actors of two each.
HEAD_CPUS = 1
WORKER_CPUS = 2
GPUS_PER_WORKER = 1
# A sweep that goes past this fails instead of hanging the suite (the machine
# has 2 cores shared by every node's processes: a minute or two is usual).
RUN_LIMIT_S = 480
# Why a node-loss sweep runs without reuse_actors unless cached actors are what
# it tests. Seen in a full run (the full-buckets test in test_cluster.py): after a worker was
# removed, Tune handed a recovering trial a cached trial actor that had died
# with that node (a cached actor's death is noticed only when it is used). The
# reset on it failed with ActorDiedError, and Tune counted that as two of the
# trial's failures (its actor-error and its task-error callbacks each process
# one), so with its own failure the trial ran past max_failures=3 and ended in
# ERROR. That is Tune's actor cache, for any class trainable, not the buckets'
# recovery. Fresh actors go only to alive nodes.
NODE_LOSS_REUSE = False


@contextmanager
def own_ray_tmpdir():
    """RAY_TMPDIR set to a fresh short directory while the block runs.

    ``Cluster`` writes its address to ``<RAY_TMPDIR>/ray/ray_current_cluster``,
    where a plain ``ray.init()`` elsewhere on this machine would find it and
    connect. Short, because Ray's socket paths must stay under 108 bytes.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rc", dir="/tmp"))
        yield


@contextmanager
def fake_cluster(workers: int = 2, gpus_per_worker: int = GPUS_PER_WORKER, head_cpus: int = HEAD_CPUS):
    """A head (the driver and the pool; CPUs, no GPU) and ``workers`` nodes with
    CPUs and GPUs, the driver connected; shut down on leaving."""
    if ray.is_initialized():
        ray.shutdown()
    with own_ray_tmpdir():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
        try:
            nodes = [cluster.add_node(num_cpus=WORKER_CPUS, num_gpus=gpus_per_worker) for _ in range(workers)]
            ray.init(address=cluster.address, configure_logging=False)
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()


def with_workers(cluster, workers: list, count: int) -> list:
    """The alive ones of ``workers``, and new nodes of the module's shape
    added to ``cluster`` until there are ``count`` (a test that removed one
    leaves the cluster short for the next)."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    kept = [w for w in workers if w.node_id in alive]
    while len(kept) < count:
        kept.append(cluster.add_node(num_cpus=WORKER_CPUS, num_gpus=GPUS_PER_WORKER))
    cluster.wait_for_nodes()
    return kept


@contextmanager
def never_hangs(limit_s: int = RUN_LIMIT_S):
    """Fail (not hang) when the block takes longer than ``limit_s``."""
    def expire(signum, frame):
        raise TimeoutError(f"the sweep ran past {limit_s}s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit_s)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def loads_where_it_runs(log_dir: str):
    """``digits()``, leaving in ``log_dir`` a file named for the node and process that loaded it."""
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "no-ray"
    with open(os.path.join(log_dir, f"{node}.{os.getpid()}"), "w"):
        pass
    return digits()


def nodes_that_loaded(log_dir: str) -> set[str]:
    return {name.split(".")[0] for name in os.listdir(log_dir)}


def assert_on_reference(result, iterations: int) -> None:
    """Every iteration the trial reported equals ``reference.train``'s for its
    config and seed, and the member's own iteration count is Tune's
    ``training_iteration``: a member that resumed went on from its checkpoint,
    not from scratch."""
    config = {"lr": result.config["lr"], "seed": result.config["seed"]}
    # A task of its own: it loads the data here, in the driver.
    history, _ = reference.train(digits_task(), config, seed=config["seed"], iterations=iterations)
    got = by_iteration(result)  # a resumed trial's table may hold only its rows after the resume
    assert max(got) == iterations
    for iteration, value in got.items():
        assert value == pytest.approx(history[iteration - 1]["val_loss"], rel=1e-5), (config, iteration)
    frame = result.metrics_dataframe
    assert (frame["iteration"] == frame["training_iteration"]).all()


class OpenBuckets(tune.Callback):
    """Reads the pool's stats as results arrive, until one reading shows at
    least ``buckets`` buckets that have trained and are open at once, on at
    least ``nodes`` distinct nodes (``seen``: that reading's open buckets)."""

    def __init__(self, nodes: int = 1, buckets: int = 1):
        self.nodes, self.buckets, self.seen = nodes, buckets, None

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.seen is None:
            running = {name: s for name, s in bucket_stats().items()
                       if not s["closed"] and s.get("iterations", 0) >= 1}
            if len(running) >= self.buckets and len({s["node_id"] for s in running.values()}) >= self.nodes:
                self.seen = running


def sweep(storage: str, trials: int, bucket_size: int, iterations: int, callbacks: list = (),
          data_log: str | None = None, search: bool = True, reuse_actors: bool = True,
          **run) -> tune.ResultGrid:
    """``trials`` configs (8 learning rates times seeds 0, 1, ...) under FIFO,
    seated by ChorusSearch (``search``; else Tune's default search: each trial
    builds a member of its own); members train to ``iterations`` on their own.
    ``data_log``: the buckets note there where they loaded the data.

    A sweep that loses a node passes ``reuse_actors=NODE_LOSS_REUSE``, or, where
    cached actors are part of what it tests, gives its trials the failures a
    cached actor that died with the node costs (see NODE_LOSS_REUSE)."""
    data = digits if data_log is None else functools.partial(loads_where_it_runs, data_log)
    task = Task(model=mlp, data=data, optimizer="sgd", batch_size=64)
    trainable = ChorusTrainable.for_task(task, bucket_size=bucket_size)
    lrs = [0.02 * (i + 1) for i in range(8)]
    return tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(lrs), "seed": tune.grid_search(list(range(trials // len(lrs))))},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=trials if search else 1,
                                    reuse_actors=reuse_actors,
                                    search_alg=ChorusSearch(task=trainable, max_iterations=iterations)
                                    if search else None),
        run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": iterations}, verbose=0,
                                  callbacks=list(callbacks), **run)).fit()
