"""What the pool opens a new bucket with (chorus_tune.tune.rules.opening), no Ray."""
from chorus_tune.tune.rules.opening import actor_options, new_bucket_options
from chorus_tune.tune.values.options import BucketOptions

RUN = BucketOptions(bucket_size="auto", idle_close_s=9.0, route="vmap")


def test_an_auto_sized_bucket_is_given_its_measured_size_as_a_number():
    assert new_bucket_options(RUN, 12, {"GPU": 1.0}).bucket_size == 12


def test_a_bucket_is_given_the_resources_it_claims_in_hashable_form():
    opened = new_bucket_options(RUN, 12, {"GPU": 0.5, "CPU": 2.0})
    assert opened.resources_per_bucket == (("CPU", 2.0), ("GPU", 0.5))


def test_a_bucket_keeps_the_runs_other_options():
    opened = new_bucket_options(RUN, 12, {"GPU": 1.0})
    assert (opened.idle_close_s, opened.route) == (9.0, "vmap")


def test_a_bucket_actor_is_created_outside_every_trials_placement_group():
    assert actor_options("b", "ns", {"GPU": 1.0})["scheduling_strategy"] == "DEFAULT"


def test_a_bucket_actor_is_never_restarted():
    assert actor_options("b", "ns", {"GPU": 1.0})["max_restarts"] == 0


def test_a_bucket_actor_is_named_in_the_pools_namespace():
    options = actor_options("chorus-bucket-1", "chorus_tune", {"GPU": 1.0})
    assert (options["name"], options["namespace"]) == ("chorus-bucket-1", "chorus_tune")


def test_a_bucket_actor_claims_its_gpus_and_custom_resources_but_no_cpus():
    options = actor_options("b", "ns", {"CPU": 4.0, "GPU": 0.5, "accel": 1.0})
    assert (options["num_cpus"], options["num_gpus"], options["resources"]) == (0, 0.5, {"accel": 1.0})
