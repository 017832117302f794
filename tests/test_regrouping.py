"""Survivors move together: the regrouping rule (chorus_tune.tune.rules.regrouping), no Ray.

Which members leave a sparse bucket for which other bucket of their key, and
the cohort rule that keeps moved members apart from the ones they meet there
(docs/design.md D3, D12).
"""
from __future__ import annotations

import pathlib
import sys

from chorus_tune.tune.rules.members import MemberBook, Phase
from chorus_tune.tune.rules.regrouping import (
    BucketView,
    MemberView,
    Unit,
    broken_units,
    member_view,
    merge_in_reach,
    plan_regroup,
    units_of,
)
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.plan import Plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import regroup_sim  # noqa: E402  (benchmarks/ is not a package)

ASHA = Plan(budget=16, bucket_decides=True, rungs=(1, 4), reduction_factor=4.0, metric="score", sign=1.0)


def lone(name: str, **kw) -> MemberView:
    """A member past its last rung: only its budget ahead."""
    return MemberView(name, **kw)


def cohort(names: str, token: str | None = None, **kw) -> tuple[MemberView, ...]:
    """Members with a rung ahead, of one cohort token."""
    return tuple(MemberView(n, token, rungs_ahead=True, **kw) for n in names)


def bucket(name: str, members=(), capacity: int = 16, **kw) -> BucketView:
    return BucketView(name, capacity, tuple(members), **kw)


def moved(moves) -> dict[str, tuple[str, str]]:
    """{member: (from, to)} of a plan."""
    return {m: (mv.source, mv.dest) for mv in moves for m in mv.members}


# ----- which buckets empty, and where into -------------------------------------------------------------
def test_the_sparsest_bucket_empties_into_the_fullest_that_has_room():
    plan = plan_regroup([bucket("a", [lone("a1"), lone("a2")]), bucket("b", [lone("b1")]),
                         bucket("c", [lone(f"c{i}") for i in range(5)])])
    # b (1 live) empties first, into c (the fullest); then a (2) into c too.
    assert moved(plan) == {"b1": ("b", "c"), "a1": ("a", "c"), "a2": ("a", "c")}


def test_lone_survivors_of_many_buckets_pack_into_as_few_buckets_as_hold_them():
    buckets = [bucket(f"b{i}", [lone(f"m{i}")], capacity=4) for i in range(8)]
    plan = plan_regroup(buckets)
    kept = {name for name in (b.name for b in buckets)} - {mv.source for mv in plan}
    assert len(kept) == 2  # 8 members, 4 slots a bucket
    assert len(moved(plan)) == 6


def test_nothing_moves_while_a_member_of_the_key_waits_for_a_slot():
    # It refills the free slots instead: no move needed.
    assert plan_regroup([bucket("a", [lone("a1")]), bucket("b", [lone("b1")])], waiting=1) == []


def test_a_bucket_that_cannot_empty_into_the_others_keeps_its_members():
    # Moving some of a bucket's members saves no fused iteration: it stays open anyway.
    full = [lone(f"b{i}") for i in range(15)]
    assert plan_regroup([bucket("a", [lone("a1"), lone("a2")]), bucket("b", full)]) == []


def test_a_bucket_with_a_member_that_cannot_move_is_not_emptied():
    held = MemberView("a2", movable=False)  # held at a rung, being built, at its queue's bound...
    assert plan_regroup([bucket("a", [lone("a1"), held], capacity=2), bucket("b", [lone("b1")])]) == []
    # b itself empties into a, around the member that cannot move.
    assert moved(plan_regroup([bucket("a", [lone("a1"), held]), bucket("b", [lone("b1")])])) == {"b1": ("b", "a")}


def test_members_not_built_yet_keep_their_bucket_open_and_count_against_its_room():
    assert moved(plan_regroup([bucket("a", [lone("a1")], pending=1), bucket("b", [lone("b1")])])) == {"b1": ("b", "a")}
    assert plan_regroup([bucket("a", [lone("a1")], pending=1, capacity=2), bucket("b", [lone("b1")])]) == []


def test_a_bucket_that_is_not_ready_neither_gives_nor_takes():
    # Not started, compacting, in another move, or its book disagreeing with the pool.
    assert plan_regroup([bucket("a", [lone("a1")], ready=False), bucket("b", [lone("b1")])]) == []


def test_members_move_only_between_buckets_on_one_device():
    plan = plan_regroup([bucket("a", [lone("a1")], place="gpu0"), bucket("b", [lone("b1")], place="gpu1"),
                         bucket("c", [lone("c1"), lone("c2")], place="gpu1")])
    assert moved(plan) == {"b1": ("b", "c")}


def test_a_member_whose_trial_still_reads_an_earlier_bucket_does_not_move_again():
    # Its trial reads the old bucket's results first; moved again, it would skip those it left in between.
    plan = plan_regroup([bucket("a", [lone("a1")]), bucket("b", [lone("b1"), lone("b2")])], draining={"a1"})
    assert moved(plan) == {"b1": ("b", "a"), "b2": ("b", "a")}


def test_an_emptied_bucket_takes_no_member_and_a_filled_one_gives_none_in_one_round():
    plan = plan_regroup([bucket("a", [lone("a1")]), bucket("b", [lone("b1")]), bucket("c", [lone("c1")])])
    sources = {mv.source for mv in plan}
    dests = {mv.dest for mv in plan}
    assert not sources & dests
    assert len(sources) == 2


# ----- cohorts move whole, and never mix ---------------------------------------------------------------
def test_a_cohort_with_a_rung_ahead_moves_whole_into_one_bucket_or_not_at_all():
    # Four survivors of one cohort: b and c have room for three and two; all four fit nowhere at once.
    units = cohort("wxyz")
    stay = dict(movable=False)
    others = [bucket("b", [lone(f"b{i}", **stay) for i in range(13)]),
              bucket("c", [lone(f"c{i}", **stay) for i in range(14)])]
    assert plan_regroup([bucket("a", units), *others]) == []
    # With room for four in one bucket, they go there together.
    plan = plan_regroup([bucket("a", units), bucket("b", [lone(f"b{i}") for i in range(12)])])
    assert moved(plan) == {m: ("a", "b") for m in "wxyz"} and len(plan[0].units) == 1


def test_members_past_their_last_rung_may_spread_over_several_buckets():
    plan = plan_regroup([bucket("a", [lone("a1"), lone("a2")]), bucket("b", [lone(f"b{i}") for i in range(15)]),
                         bucket("c", [lone(f"c{i}") for i in range(15)])])
    assert sorted(dest for _, dest in moved(plan).values()) == ["b", "c"]


def test_members_of_a_bucket_form_one_unit_per_cohort_token_and_one_per_member_past_its_last_rung():
    units = units_of([*cohort("ab"), *cohort("cd", "x/1"), lone("e")])
    assert sorted(u.members for u in units) == [("a", "b"), ("c", "d"), ("e",)]
    assert next(u for u in units if u.members == ("c", "d")).cohort == "x/1"


def test_a_unit_never_moved_gets_a_new_token_and_a_moved_one_keeps_its_own():
    assert Unit(("a",), None, rungs_ahead=True).carries("b1/7") == "b1/7"
    assert Unit(("a",), "b0/3", rungs_ahead=True).carries("b1/7") == "b0/3"
    assert Unit(("a",), None, rungs_ahead=False).carries("b1/7") is None  # no cohort decision left


def test_taking_part_of_a_cohort_out_of_its_bucket_is_refused():
    in_slots = [*cohort("abc"), *cohort("de", "x/1"), lone("f")]
    assert broken_units(in_slots, {"a", "b"}) == ["c"]
    assert broken_units(in_slots, {"a", "b", "c", "f"}) == []
    assert broken_units(in_slots, {"d"}) == ["e"]


def test_a_member_view_says_whether_a_rung_lies_ahead_and_whether_it_can_move():
    book = MemberBook()
    for name, iteration in (("fresh", 0), ("survivor", 1), ("last", 4)):
        book.reserve(name, ASHA)
        book.place(name, len(book.records) - 1, iteration)
    views = {r.member: member_view(r, book.limit(r)) for r in book.in_slots()}
    assert views["fresh"].rungs_ahead and views["survivor"].rungs_ahead and not views["last"].rungs_ahead
    assert all(v.movable for v in views.values())
    book.get("fresh").building = True
    assert not member_view(book.get("fresh"), book.limit(book.get("fresh"))).movable


def test_a_member_held_alone_at_a_rung_can_move_with_its_hold():
    # It trains no more until its trial asks past the rung (its limit is the
    # rung it reached), but it moves, and MemberBook.place holds it there again.
    book = MemberBook()
    book.reserve("a", ASHA)
    book.place("a", 0, 0)
    book.record({"a": ({"score": 0.5}, None)})  # alone at rung 1: held there
    record = book.get("a")
    assert record.phase is Phase.HELD and book.limit(record) == record.produced == 1
    assert member_view(record, book.limit(record)).movable


def test_a_member_at_its_queues_bound_does_not_move():
    book = MemberBook(max_queue=2)
    book.reserve("a", ASHA)
    book.place("a", 0, 4)  # past its last rung: nothing holds it but the queue
    book.record({"a": ({"score": 0.5}, None)})
    book.record({"a": ({"score": 0.5}, None)})
    record = book.get("a")
    assert record.phase is Phase.TRAINING and not member_view(record, book.limit(record)).movable


def test_a_bucket_that_could_become_one_with_another_of_its_key_does_not_compact():
    seven, six = bucket("a", [lone(f"a{i}") for i in range(7)]), bucket("b", [lone(f"b{i}") for i in range(6)])
    assert merge_in_reach([seven, six], "a") and merge_in_reach([seven, six], "b")


def test_a_bucket_whose_members_and_a_siblings_fill_more_than_one_bucket_compacts():
    nine, eight = bucket("a", [lone(f"a{i}") for i in range(9)]), bucket("b", [lone(f"b{i}") for i in range(8)])
    assert not merge_in_reach([nine, eight], "a")


def test_a_compacted_sibling_still_takes_a_bucket_that_fits_its_free_slots():
    # b compacted to its 6 members: a's 7 can no longer go there, but b's 6 fit into a's 16 slots.
    seven, compacted = bucket("a", [lone(f"a{i}") for i in range(7)]), bucket("b", [lone(f"b{i}") for i in range(6)],
                                                                             capacity=6)
    assert merge_in_reach([seven, compacted], "a")


def test_a_bucket_compacts_when_its_only_sibling_runs_elsewhere_or_is_decided_by_tune():
    mine = bucket("a", [lone("a0")], place="gpu0")
    assert not merge_in_reach([mine, bucket("b", [lone("b0")], place="gpu1")], "a")
    tunes = bucket("b", [lone("b0", bucket_decides=False)], place="gpu0")
    assert not merge_in_reach([mine, tunes], "a") and not merge_in_reach([mine, tunes], "b")
    assert not merge_in_reach([mine], "a") and not merge_in_reach([], "a")


def test_a_member_whose_decisions_are_tunes_does_not_move():
    # Tune's stops and continues are counted per bucket (decision points): a move would count them twice.
    book = MemberBook()
    book.reserve("a", Plan(budget=10, speculate=True))
    book.place("a", 0, 0)
    assert not member_view(book.get("a"), book.limit(book.get("a"))).movable


def _rung_four(book: MemberBook, members: dict[str, float]) -> None:
    book.record({m: ({"score": s}, None) for m, s in members.items()})


def test_members_moved_in_are_halved_only_with_their_own_cohort():
    # A bucket's own four survivors of rung 1 and four moved in from another
    # bucket (one token) reach rung 4 in the same fused iteration: two cohorts
    # of four, each keeping its best one, never one cohort of eight.
    book = MemberBook()
    own = {"o1": 0.9, "o2": 0.8, "o3": 0.7, "o4": 0.6}
    guests = {"g1": 0.5, "g2": 0.4, "g3": 0.3, "g4": 0.2}  # all worse than every one of ours
    for slot, name in enumerate([*own, *guests]):
        book.reserve(name, ASHA)
        book.place(name, slot, 3)
        book.get(name).cohort = "b0/1" if name in guests else None
    _rung_four(book, {**own, **guests})
    decided = {m: book.get(m).queue[-1].result for m in [*own, *guests]}
    assert {m for m, r in decided.items() if r[rk.DECISION] == "CONTINUE"} == {"o1", "g1"}
    assert all(r[rk.COHORT_SIZE] == 4 for r in decided.values())
    assert all(decided[g][rk.COHORT] == "b0/1" for g in guests) and rk.COHORT not in decided["o1"]


def test_a_simulated_sweep_regrouped_never_compares_members_of_two_cohorts():
    # Every cohort halved at rung 4 is made of survivors of one rung-1 cohort,
    # though survivors of several buckets were moved together.
    out = regroup_sim.simulate(trials=64, capacity=8, max_buckets=4, lookahead=64)
    assert out.moves >= 1
    assert regroup_sim.lineage_holds(out, first_rung=1)


def test_a_simulated_sweep_runs_fuller_buckets_when_survivors_regroup():
    before = regroup_sim.simulate(trials=128, lookahead=128, regroup=False)
    after = regroup_sim.simulate(trials=128, lookahead=128, regroup=True)
    assert after.member_iterations == before.member_iterations  # the same training, fewer fused iterations
    assert len(after.lives) < len(before.lives) and after.mean_live > before.mean_live
