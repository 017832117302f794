"""Who shares a bucket and who may take an empty one over (chorus_tune.tune.execution.grouping), no Ray."""
from chorus_tune.tune.execution.grouping import GroupKey, can_rebind, split_from

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


# ----- who may take over an empty bucket (its repr and its claim stay true) ---------------------
class _Options:
    def __init__(self, resources=None):
        self.resources_per_bucket = resources


OPEN = GroupKey("task", _Options(), "MLP", ("relu",))


def test_a_bucket_of_the_same_model_class_and_claim_may_host_another_task_structure_and_size():
    assert can_rebind(OPEN, 8, GroupKey("other", _Options(), "MLP", ("tanh",)), 16)


def test_a_bucket_may_not_host_a_model_of_another_name():
    assert not can_rebind(OPEN, 8, OPEN._replace(model_name="CNN"), 8)


def test_a_bucket_may_not_host_a_key_that_claims_other_resources():
    assert not can_rebind(OPEN, 8, OPEN._replace(options=_Options((("GPU", 0.5),))), 8)
