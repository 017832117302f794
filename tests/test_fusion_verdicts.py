"""Which structures train solo because fusing them measured too small a gain
(chorus_tune/tune/rules/fusion_verdicts.py; Ray-free)."""
from __future__ import annotations

from chorus_tune.fusion_gain import FusionGain
from chorus_tune.tune.rules.fusion_verdicts import PROBE_MEMBERS, FusionVerdicts, measuring_order


def _gain(ratio: float) -> FusionGain:
    return FusionGain(members=4, steps=4, fused_s=4.0 / ratio, own_s=1.0, route="vmap")


def test_structures_that_two_members_or_more_share_are_measured_on_their_first_members():
    seating = [("a", {"lr": i}, i) for i in range(12)] + [("b", {"lr": 0}, 0)] + [("c", {}, 1), ("c", {}, 2)]
    samples = FusionVerdicts().to_measure(seating, {"a": 16, "b": 16, "c": 16})
    assert set(samples) == {"a", "c"}  # b sits alone: it trains solo anyway
    assert samples["a"] == [({"lr": i}, i) for i in range(PROBE_MEMBERS)]
    assert samples["c"] == [({}, 1), ({}, 2)]


def test_no_more_members_are_measured_than_would_share_a_bucket():
    seating = [("a", {"lr": i}, i) for i in range(12)]
    assert FusionVerdicts().to_measure(seating, {"a": 3})["a"] == [({"lr": i}, i) for i in range(3)]
    assert FusionVerdicts().to_measure(seating, {"a": 1}) == {}  # buckets of one fuse nothing


def test_a_structure_is_measured_once():
    verdicts = FusionVerdicts()
    verdicts.judge("a", _gain(2.0))
    assert verdicts.to_measure([("a", {}, 0), ("a", {}, 1)], {"a": 16}) == {}


def test_a_structure_that_gains_less_than_the_floor_trains_solo():
    verdicts = FusionVerdicts()
    verdicts.judge("slow", _gain(1.1))
    verdicts.judge("fast", _gain(2.5))
    assert verdicts.trains_solo("slow", 1.3)
    assert not verdicts.trains_solo("fast", 1.3)


def test_a_gain_at_the_floor_shares_buckets():
    verdicts = FusionVerdicts()
    verdicts.judge("a", _gain(1.3))
    assert not verdicts.trains_solo("a", 1.3)


def test_a_structure_not_measured_or_not_measurable_shares_buckets():
    verdicts = FusionVerdicts()
    verdicts.judge("dataset", None)
    assert not verdicts.trains_solo("dataset", 1.3)
    assert not verdicts.trains_solo("never seen", 1.3)


def test_no_floor_means_no_structure_trains_solo_for_its_gain():
    verdicts = FusionVerdicts()
    verdicts.judge("slow", _gain(0.5))
    assert not verdicts.trains_solo("slow", None)


def test_solo_below_is_a_positive_factor_or_none():
    import pytest

    from chorus_tune.tune.values.options import BucketOptions

    assert BucketOptions(solo_below=None).solo_below is None
    assert BucketOptions().solo_below == 1.3
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="solo_below"):
            BucketOptions(solo_below=bad)


def test_a_seating_trains_solo_only_where_every_structure_measured_gains_too_little():
    verdicts = FusionVerdicts()
    verdicts.judge("cnn b4", _gain(0.9))
    verdicts.judge("cnn b16", _gain(0.7))
    # "lone": one member in the seating, never measured; it trains solo anyway (rules/solo.py).
    assert verdicts.solo_keys({"cnn b4", "cnn b16", "lone"}, 1.3) == {"cnn b4", "cnn b16"}


def test_one_structure_that_gains_enough_keeps_every_structure_of_its_seating_in_buckets():
    verdicts = FusionVerdicts()
    verdicts.judge("w64", _gain(3.0))
    verdicts.judge("w256", _gain(1.2))
    assert verdicts.solo_keys({"w64", "w256"}, 1.3) == set()


def test_a_structure_that_could_not_be_measured_keeps_its_seating_in_buckets():
    verdicts = FusionVerdicts()
    verdicts.judge("slow", _gain(0.8))
    verdicts.judge("dataset", None)
    assert verdicts.solo_keys({"slow", "dataset"}, 1.3) == set()


def test_a_seating_with_nothing_measured_sends_nothing_solo():
    assert FusionVerdicts().solo_keys({"lone"}, 1.3) == set()
    verdicts = FusionVerdicts()
    verdicts.judge("slow", _gain(0.8))
    assert verdicts.solo_keys({"slow"}, None) == set()


# Keys of the kin tests: (model, batch size); a family is a model.
def _family(key):
    return key[0]


def _batch(key):
    return key[1]


def test_one_structure_per_family_is_measured_the_one_with_the_smallest_batch():
    samples = {("cnn", 16): [0] * 8, ("cnn", 2): [0] * 3, ("cnn", 4): [0] * 8}
    ((measured, kin),) = measuring_order(samples, _family, _batch)
    assert measured == ("cnn", 2)
    assert set(kin) == {("cnn", 16), ("cnn", 4)}


def test_of_a_familys_structures_at_one_batch_size_the_one_with_more_members_is_measured():
    samples = {("cnn", 4, "narrow"): [0] * 2, ("cnn", 4, "wide"): [0] * 5}
    ((measured, kin),) = measuring_order(samples, _family, _batch)
    assert measured == ("cnn", 4, "wide") and kin == [("cnn", 4, "narrow")]


def test_families_are_measured_most_members_first():
    samples = {("mlp", 8): [0] * 2, ("cnn", 8): [0] * 2, ("cnn", 16): [0] * 2}
    assert [measured for measured, _ in measuring_order(samples, _family, _batch)] == [("cnn", 8), ("mlp", 8)]


def test_a_structure_judged_with_its_kin_takes_its_verdict_and_is_not_measured_again():
    verdicts = FusionVerdicts()
    verdicts.judge(("cnn", 2), _gain(0.9))
    verdicts.judge_with(("cnn", 16), ("cnn", 2))
    assert verdicts.trains_solo(("cnn", 16), 1.3)
    assert verdicts.to_measure([(("cnn", 16), {}, 0), (("cnn", 16), {}, 1)], {("cnn", 16): 16}) == {}
    assert verdicts.solo_keys({("cnn", 2), ("cnn", 16)}, 1.3) == {("cnn", 2), ("cnn", 16)}


def test_once_a_seating_of_the_run_shares_buckets_later_ones_do_whatever_they_measure():
    verdicts = FusionVerdicts()
    verdicts.judge("w64", _gain(2.8))
    assert verdicts.solo_keys({"w64"}, 1.3) == set()
    verdicts.judge("w256", _gain(1.2))  # a later seating's new structure
    assert verdicts.solo_keys({"w256"}, 1.3) == set()


def test_a_new_run_judges_its_seatings_afresh():
    verdicts = FusionVerdicts()
    verdicts.judge("w64", _gain(2.8))
    verdicts.solo_keys({"w64"}, 1.3)
    verdicts.new_run()
    verdicts.judge("cnn", _gain(0.8))
    assert verdicts.solo_keys({"cnn"}, 1.3) == {"cnn"}


def test_a_seating_is_not_measured_where_one_of_its_structures_is_known_to_gain_enough():
    verdicts = FusionVerdicts()
    verdicts.judge("w64", _gain(2.8))
    verdicts.judge("slow", _gain(0.8))
    assert not verdicts.needs_measuring({"w64", "w128"}, 1.3)
    assert verdicts.needs_measuring({"slow", "w128"}, 1.3)
    assert not verdicts.needs_measuring({"slow", "w128"}, None)


def test_nothing_is_measured_once_the_run_shares_buckets():
    verdicts = FusionVerdicts()
    verdicts.judge("w64", _gain(2.8))
    verdicts.solo_keys({"w64"}, 1.3)
    assert not verdicts.needs_measuring({"w256"}, 1.3)
