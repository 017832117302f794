"""Who shares a bucket (chorus_tune.tune.rules.grouping), no Ray."""
from chorus_tune.tune.rules.grouping import GroupKey, split_from

KEY = GroupKey("task", "options", "MLP", ("relu",))


def test_a_new_structure_of_a_model_seen_splits_from_it():
    assert split_from(KEY._replace(structural_key=("tanh",)), [KEY]) == KEY


def test_a_model_of_another_name_does_not_split_from_it():
    assert split_from(KEY._replace(model_name="CNN", structural_key=("cnn",)), [KEY]) is None


def test_a_structure_of_another_task_does_not_split_from_it():
    assert split_from(KEY._replace(task_id="other", structural_key=("tanh",)), [KEY]) is None


def test_a_structure_under_other_options_does_not_split_from_it():
    assert split_from(KEY._replace(options="others", structural_key=("tanh",)), [KEY]) is None


def test_a_first_key_splits_from_nothing():
    assert split_from(KEY, []) is None


def test_widths_are_judged_for_the_gpu_where_a_bucket_claims_one():
    from chorus_tune.tune.rules.grouping import width_device

    assert width_device({"GPU": 0.5, "CPU": 1}) == "cuda"
    assert width_device({"CPU": 1}) == "cpu"
