"""Several GPUs on one node (docs/design.md D14): with 4 GPUs declared, 4 buckets run at once,
each on its own card, whose index Ray assigned on that node.

Ray declares the GPUs (``num_gpus=4``) without needing cards; a bucket whose
torch has no CUDA trains on the CPU and says so. Slow (a minute or more on 2
cores): deselect with ``-m "not cluster"``.
"""
from __future__ import annotations

import pytest
import ray

from chorus_tune.tune import bucket_stats

from cluster_support import OpenBuckets, assert_on_reference, never_hangs, sweep

pytestmark = pytest.mark.cluster

GPUS = 4


@pytest.fixture(scope="module")
def four_gpus():
    """One node (this machine) declaring four GPUs, and a CPU for each bucket's
    thread (the default bucket counts one: a node with fewer CPUs than GPUs
    opens fewer buckets)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=GPUS, num_gpus=GPUS, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_four_declared_gpus_run_four_buckets_at_once_each_on_its_own_card(four_gpus, tmp_path):
    import torch

    watch = OpenBuckets(buckets=GPUS)
    with never_hangs():
        # 8 trials in buckets of 2: a bucket per GPU, as 16 in buckets of 4, with half the trial actors.
        results = sweep(str(tmp_path / "runs"), trials=8, bucket_size=2, iterations=2, callbacks=[watch])

    assert len(results) == 8 and not results.errors
    for result in results:
        assert_on_reference(result, iterations=2)
    ours = {r.metrics["chorus/bucket"] for r in results}
    stats = [s for name, s in bucket_stats().items() if name in ours]
    # One bucket per GPU, each given its own card by Ray: ids 0-3 of this node.
    assert sorted(s["gpu_ids"] for s in stats) == [[str(i)] for i in range(GPUS)]
    # Each process sees only its card, as cuda:0; without CUDA it trains on the CPU, and says so.
    assert all(s["requested_device"] == "cuda:0" for s in stats)
    assert all(s["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu") for s in stats)
    # At one moment, all four had trained and were open.
    assert watch.seen is not None and len(watch.seen) == GPUS
    print("figures:", {"gpu ids": sorted(s["gpu_ids"][0] for s in stats),
                       "devices": sorted(s["device"] for s in stats), "open at once": len(watch.seen)})
