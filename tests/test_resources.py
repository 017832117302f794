"""How buckets and trials share a cluster's resources, where a bucket trains, and member seeds (Ray-free)."""
from __future__ import annotations

import pytest

from chorus_tune.tune.rules.resources import (
    bucket_actor_options,
    bucket_budget,
    default_bucket_resources,
    pick_device,
    shared_threads,
    training_buckets,
    trial_token_cpu,
)
from chorus_tune.tune.values.options import BucketOptions, RungSchedule, derived_seed, member_seed


def test_cpu_only_cluster_gets_one_bucket_per_core_and_a_token_per_slot():
    cluster = {"CPU": 2.0}
    per_bucket = default_bucket_resources(cluster)
    assert per_bucket == {"CPU": 1.0} and bucket_budget(cluster, per_bucket) == 2
    token = trial_token_cpu(cluster, per_bucket, bucket_size=8)
    assert token == 0.125 and 16 * token <= 2.0
    assert bucket_actor_options(per_bucket) == {"num_cpus": 0, "num_gpus": 0.0}


def test_gpu_cluster_claims_whole_gpus_and_fractions_share_a_card():
    cluster = {"CPU": 16.0, "GPU": 2.0}
    assert default_bucket_resources(cluster) == {"GPU": 1.0, "CPU": 1.0}
    assert bucket_budget(cluster, {"GPU": 0.5, "CPU": 1}) == 4
    assert bucket_actor_options({"GPU": 0.5, "CPU": 1})["num_gpus"] == 0.5


def test_token_never_rounds_to_zero():
    assert trial_token_cpu({"CPU": 1.0}, {"CPU": 1.0}, bucket_size=100000) == pytest.approx(1e-4)


def test_member_seed_is_the_config_seed_else_stable_per_trial():
    assert member_seed({"seed": 9}, "abc_00001") == 9
    assert member_seed({}, "abc_00001") == derived_seed("abc_00001") == member_seed({}, "abc_00001")
    assert derived_seed("abc_00001") != derived_seed("abc_00002")


def test_a_budget_the_user_gives_lets_members_run_ahead_to_it():
    plan = BucketOptions(max_iterations=10).plan()
    assert plan.bucket_decides and plan.budget == 10


def test_a_stopper_caps_members_but_tune_still_decides_it():
    plan = BucketOptions(run_ahead=3).plan(stop_at=10)
    assert not plan.bucket_decides and plan.budget == 10 and plan.run_ahead == 3


def test_chorus_asha_rungs_below_the_budget_are_decided_in_the_bucket():
    schedule = RungSchedule(rungs=(1, 4, 16), max_t=20, reduction_factor=4, metric="val_loss", sign=-1.0)
    plan = BucketOptions().plan(schedule, stop_at=10)
    assert plan.bucket_decides and plan.budget == 10 and plan.rungs == (1, 4)
    assert plan.metric == "val_loss" and plan.sign == -1.0


def test_bad_run_ahead_options_are_refused():
    with pytest.raises(ValueError, match="run_ahead"):
        BucketOptions(run_ahead=-1)
    with pytest.raises(ValueError, match="max_iterations"):
        BucketOptions(max_iterations=0)


def test_a_bucket_without_a_gpu_trains_on_the_cpu():
    choice = pick_device([], None, cuda_available=True)
    assert (choice.requested, choice.device, choice.fell_back) == ("cpu", "cpu", False)


def test_a_bucket_trains_on_the_card_ray_gave_it_as_its_process_sees_it():
    # Ray restricts each actor's CUDA_VISIBLE_DEVICES to its own GPUs: GPU 3 of
    # a node is then cuda:0 in that process, whatever the other buckets hold.
    assert pick_device([3], "3", cuda_available=True).device == "cuda:0"
    # Unrestricted (Ray told not to set it), torch sees every card of the node.
    assert pick_device([1], "0,1,2,3", cuda_available=True).device == "cuda:1"
    assert pick_device([2], None, cuda_available=True).device == "cuda:2"


def test_a_gpu_declared_where_torch_has_no_cuda_falls_back_to_the_cpu_and_says_so():
    choice = pick_device(["1"], "1", cuda_available=False)
    assert choice.requested == "cuda:0" and choice.device == "cpu" and choice.fell_back
    assert choice.gpu_ids == ("1",)


def test_a_gpu_hidden_from_the_bucket_is_a_clear_error():
    with pytest.raises(ValueError, match="GPU 2.*CUDA_VISIBLE_DEVICES"):
        pick_device([2], "0,1", cuda_available=True)


def test_buckets_share_the_cores_of_their_own_node_not_the_clusters():
    threads = shared_threads({"a": 2.0, "b": 8.0}, {"x": "a", "y": "a", "z": "b", "starting": None})
    # Two buckets on the 2-core node, one on the 8-core node; one still starting keeps its own.
    assert threads == {"x": 1, "y": 1, "z": 8}


def test_the_buckets_with_members_to_train_share_the_cores_not_those_only_waiting_to_be_read():
    assert training_buckets(["done", "busy"], lambda b: b == "busy") == ["busy"]
    # A lone training bucket on a 2-core node gets both cores.
    assert shared_threads({"a": 2.0}, {"busy": "a"}) == {"busy": 2}


def test_when_no_bucket_has_members_every_bucket_shares_the_cores():
    assert training_buckets(["x", "y"], lambda b: False) == ["x", "y"]


# Issue 40 item 5: Ray's view of the CPUs matches the cores the buckets compute
# on. Buckets claim no CPU (a bucket can always start: one claiming a CPU waits
# for good under Tune's default search, whose trials take every free CPU), so
# the trials' tokens hold the buckets' cores instead.

def test_under_chorus_search_the_trials_tokens_hold_every_core_the_buckets_share():
    cluster = {"CPU": 2.0}
    per_bucket = default_bucket_resources(cluster)
    # The tutorial's shape: ChorusSearch runs 2 trials at once; before, each
    # asked for 2 / 32 slots and Ray saw 0.125 of 2 CPUs in use.
    token = trial_token_cpu(cluster, per_bucket, bucket_size=16, concurrency=2, shares_cores=True)
    assert token == 1.0 and 2 * token == cluster["CPU"]
    assert trial_token_cpu({"CPU": 16.0}, {"CPU": 1.0}, 16, concurrency=32, shares_cores=True) == 0.5


def test_the_tokens_of_the_concurrent_trials_always_fit_the_cluster():
    for cpus in (1.0, 2.0, 3.0, 7.0, 64.0):
        for concurrency in (1, 2, 3, 5, 7, 100, 10**4):
            token = trial_token_cpu({"CPU": cpus}, {"CPU": 1.0}, 16, concurrency=concurrency, shares_cores=True)
            assert concurrency * token <= cpus + 1e-9 and 1e-4 <= token <= 1.0


def test_a_token_is_at_most_one_cpu_so_a_trial_fits_any_node():
    # One trial on 8 cores would ask for 8, more than a node of a cluster may hold.
    assert trial_token_cpu({"CPU": 8.0}, {"CPU": 1.0}, 16, concurrency=1, shares_cores=True) == 1.0


def test_buckets_that_do_not_share_cores_are_held_at_their_own_cpus():
    # A GPU cluster: one bucket per GPU, one CPU for its thread: 2 cores of 32.
    cluster = {"CPU": 32.0, "GPU": 2.0}
    per_bucket = default_bucket_resources(cluster)
    token = trial_token_cpu(cluster, per_bucket, bucket_size=16, concurrency=32, shares_cores=False)
    assert 32 * token == pytest.approx(2.0)


def test_under_tunes_default_search_a_token_per_slot_bounds_its_trials_and_holds_every_cpu():
    # Tune runs as many trials as fit: one per slot, and together they hold every CPU.
    cluster = {"CPU": 2.0}
    token = trial_token_cpu(cluster, {"CPU": 1.0}, bucket_size=8)
    assert token == 0.125 and int(2.0 / token) == 16


def test_buckets_never_claim_a_cpu():
    assert bucket_actor_options({"CPU": 1.0})["num_cpus"] == 0
    assert bucket_actor_options({"GPU": 1.0, "CPU": 2.0})["num_cpus"] == 0


def test_a_cpu_only_bucket_has_a_spare_for_a_new_structure_unless_the_user_capped_the_buckets():
    from chorus_tune.tune.rules.resources import spare_buckets

    assert spare_buckets({"CPU": 1.0}, capped=False) == 1
    assert spare_buckets({"CPU": 1.0}, capped=True) == 0


@pytest.mark.parametrize("per_bucket", [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 0.25}, {"CPU": 1.0, "accelerator": 1.0}])
def test_a_bucket_that_claims_a_gpu_or_a_custom_resource_has_no_spare(per_bucket):
    from chorus_tune.tune.rules.resources import spare_buckets

    assert spare_buckets(per_bucket, capped=False) == 0
