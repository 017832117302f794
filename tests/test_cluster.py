"""Past one machine (docs/design.md D14): a sweep over a fake Ray cluster of a head and two
workers with two GPUs each, and where the pool and the buckets run on it.

Slow (minutes on 2 cores): deselect with ``-m "not cluster"``.
"""
from __future__ import annotations

import sys
import tempfile

import pytest
import ray
import ray.cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chorus_tune.tune import bucket_stats
from chorus_tune.tune.execution.bucket_actor import BucketActor
from chorus_tune.tune.execution.options import BucketOptions
from chorus_tune.tune.execution.pool import NAMESPACE, get_pool, pool_name

from cluster_support import (
    GPUS_PER_WORKER,
    OpenBuckets,
    assert_on_reference,
    fake_cluster,
    never_hangs,
    nodes_that_loaded,
    sweep,
)
from tune_support import digits_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    with fake_cluster() as (_, workers):
        yield workers


def test_a_sweep_runs_buckets_on_both_workers_at_once_and_every_trial_follows_the_reference(cluster, tmp_path):
    workers = {w.node_id for w in cluster}
    data_log = tempfile.mkdtemp(dir=tmp_path)
    watch = OpenBuckets(nodes=2)
    with never_hangs():
        results = sweep(str(tmp_path / "runs"), trials=32, bucket_size=8, iterations=3, callbacks=[watch],
                        data_log=data_log)

    assert len(results) == 32 and not results.errors
    for result in results:
        assert_on_reference(result, iterations=3)
    ours = {r.metrics["chorus/bucket"] for r in results}
    stats = {name: s for name, s in bucket_stats().items() if name in ours}
    # One bucket per declared GPU, all on the workers (the head declares none).
    assert len(stats) == len(cluster) * GPUS_PER_WORKER
    assert {s["node_id"] for s in stats.values()} == workers
    # At one moment, buckets that had trained were open on both workers.
    assert watch.seen is not None and {s["node_id"] for s in watch.seen.values()} == workers
    # Each bucket loaded the data on its own node; nothing loaded it on the head.
    assert nodes_that_loaded(data_log) == workers
    print("figures:", {node[:8]: {"buckets": sum(s["node_id"] == node for s in stats.values()),
                                  "trials": sum(len(s["trials"]) for s in stats.values() if s["node_id"] == node),
                                  "open at once": sum(s["node_id"] == node for s in watch.seen.values())}
                       for node in sorted(workers)})


def test_a_bucket_given_a_gpu_where_torch_has_no_cuda_trains_on_the_cpu_and_reports_it(cluster):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPUs this cluster declares are not real: a bucket would take one for a card")
    node = cluster[0].node_id
    bucket = BucketActor.options(
        num_gpus=1, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote("gpu-less", ray.cloudpickle.dumps(digits_task()), BucketOptions(bucket_size=2), "Sequential")
    try:
        where = ray.get(bucket.describe.remote())
    finally:
        ray.kill(bucket)
    # Ray gave it one of the node's GPUs and showed it only that one ...
    assert len(where["gpu_ids"]) == 1 and where["cuda_visible_devices"] == where["gpu_ids"][0]
    # ... which torch would call cuda:0; without CUDA it trains on the CPU, and says so.
    assert where["requested_device"] == "cuda:0" and where["device"] == "cpu"
    assert where["node_id"] == node


def test_the_pool_lives_on_the_head_node_whoever_creates_it(cluster):
    head = ray.get_runtime_context().get_node_id()
    job = ray.get_runtime_context().get_job_id()

    @ray.remote(num_cpus=0)
    def create_pools(count: int) -> list[str]:
        # As a trial actor on a worker does for its job, when no ChorusSearch made the pool first.
        jobs = [f"{job}-{i}" for i in range(count)]
        for job_id in jobs:
            ray.get(get_pool(create=True, job_id=job_id).__ray_ready__.remote())
        return [pool_name(job_id) for job_id in jobs]

    on_worker = NodeAffinitySchedulingStrategy(node_id=cluster[0].node_id, soft=False)
    names = ray.get(create_pools.options(scheduling_strategy=on_worker).remote(6))
    try:
        actors = ray._private.state.actors().values()
        where = {a["Name"]: a["Address"]["NodeID"] for a in actors if a["Name"] in names and a["State"] == "ALIVE"}
        # Six pools asking for no resources: under Ray's DEFAULT strategy they would land on random nodes.
        assert where == {name: head for name in names}
    finally:
        for name in names:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
