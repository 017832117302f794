"""When Tune decides, the bucket speculates (Ray-free): members train on to the
run's cap without waiting for their trials, except past the iterations where
the bucket has seen Tune stop trials early (docs/design.md D4)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from test_members import book_with, run, run_until_idle

from chorus_tune.tune.rules.members import MemberBook, Phase, StopRecord
from chorus_tune.tune.rules.stop_record import sum_counts
from chorus_tune.tune.values.options import BucketOptions
from chorus_tune.tune.values.plan import Plan
from chorus_tune.tune.values.run_plan import rank_of, stop_terms


def read_all(book: MemberBook, member: str) -> int:
    """The member's trial reads every result that is ready; returns how many."""
    n = 0
    while book.ask(member) is not None:
        n += 1
    return n


def follow(book: MemberBook, member: str) -> int:
    """The member's trial reads it to its end, the bucket training whenever it
    may in between (Tune continues it at every result); returns the reads."""
    book.attach(member)
    n = 0
    while not book.exhausted(member):
        if book.ask(member) is not None:
            n += 1
        else:
            run(book)
    return n


def clear_elsewhere(book: MemberBook, iterations, n: int = 4) -> None:
    """The run's other buckets saw ``n`` trials continued past each of ``iterations``."""
    book.stops.seen_elsewhere({}, {t: n for t in iterations})


def test_with_a_cap_and_nothing_learnt_members_train_together_to_the_first_iteration_and_no_further():
    # Every trial Tune starts reads its first result, whatever the scheduler:
    # iteration 1 is never wasted. Past it, nothing is known yet.
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 4)
    assert run_until_idle(book) == 1
    assert [book.get(f"m{i}").produced for i in range(4)] == [1, 1, 1, 1]


def test_a_fifo_run_read_to_the_cap_wastes_nothing():
    book = book_with(Plan(run_ahead=2, budget=6, speculate=True), 3)
    for i in range(3):
        assert follow(book, f"m{i}") == 6
        book.leave(f"m{i}")
    assert book.wasted == 0 and book.stops.points == ()


def test_without_speculation_the_run_ahead_bound_holds_under_a_cap():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=False), 2)
    assert run_until_idle(book) == 2


def test_without_a_cap_speculation_keeps_the_run_ahead_bound():
    book = book_with(Plan(run_ahead=2, speculate=True), 2)
    assert run_until_idle(book) == 2


def test_run_ahead_zero_stays_strict_lockstep_under_speculation():
    book = book_with(Plan(run_ahead=0, budget=10, speculate=True), 1)
    assert run_until_idle(book) == 0


def test_a_trial_stopped_early_teaches_the_bucket_a_decision_point():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 1)
    book.attach("m0")
    run(book)
    assert book.ask("m0").iteration == 1
    book.leave("m0")  # Tune stopped it after reading iteration 1
    assert book.stops.points == (1,)


def test_members_wait_at_a_learnt_decision_point_for_their_trials():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 3)
    book.stops.stop(1)
    assert run_until_idle(book) == 1
    assert [book.get(f"m{i}").produced for i in range(3)] == [1, 1, 1]


def test_a_survivor_runs_run_ahead_past_its_ask_however_far_continues_elsewhere_clear():
    # Where Tune stops trials, the first arrivals at a rung not learnt yet are
    # continued (stock ASHA), and the later ones mostly stopped: continues
    # past every iteration after 1 clear nothing for a survivor.
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 3)
    book.stops.stop(1)
    run_until_idle(book)
    clear_elsewhere(book, range(2, 10))
    book.attach("m0")
    assert book.ask("m0").iteration == 1
    assert book.ask("m0") is None  # Tune continued it past 1: it asks for 2
    run_until_idle(book)
    assert book.get("m0").produced == 4 and book.get("m1").produced == 1
    assert book.ask("m0").iteration == 2 and book.ask("m0").iteration == 3
    run_until_idle(book)
    assert book.get("m0").produced == 5  # its trial read 3: run_ahead past that again


def test_a_continued_trial_speculates_only_to_the_next_learnt_point():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 1)
    book.stops.stop(1)
    book.stops.stop(4)
    clear_elsewhere(book, (2, 3))
    book.attach("m0")
    run(book)
    book.ask("m0")
    book.ask("m0")  # continued past 1
    run_until_idle(book)
    assert book.get("m0").produced == 4


def test_a_stop_counted_as_the_leave_arrives_is_not_counted_again_when_the_member_leaves():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 1)
    run(book)
    book.attach("m0")
    book.ask("m0")  # its trial read iteration 1, then left
    assert book.count_stop("m0") and not book.count_stop("m0")
    book.leave("m0")
    assert book.stops.stopped == {1: 1} and book.stops.points == (1,)


def test_a_finished_member_leaving_teaches_nothing():
    book = book_with(Plan(run_ahead=2, budget=3, speculate=True), 1)
    follow(book, "m0")
    book.leave("m0")
    assert book.stops.points == ()


def test_a_member_never_read_leaving_teaches_nothing():
    book = book_with(Plan(run_ahead=2, budget=3, speculate=True), 1)
    run(book)
    book.leave("m0")  # seated, never bound to a trial: the sweep ended first
    assert book.stops.points == ()


def test_a_rare_early_stop_among_many_continues_is_not_a_decision_point():
    stops = StopRecord(min_stop_rate=0.1)
    for _ in range(20):
        stops.cont(3)
    stops.stop(3)  # one trial killed at 3 in a FIFO run
    assert stops.points == ()
    assert stops.next_point(1) is None


def test_a_point_is_unlearnt_when_continues_outweigh_its_stops():
    stops = StopRecord(min_stop_rate=0.5)
    stops.stop(2)
    assert stops.points == (2,)
    stops.cont(2)
    stops.cont(2)
    assert stops.points == ()


def test_a_stop_criterion_on_a_member_metric_finishes_the_member_there():
    # Tune's rule: stop at the first result with result[key] >= value.
    plan = Plan(run_ahead=2, budget=10, speculate=True, stop_criteria=(("val_loss", 0.6),))
    book = book_with(plan, 2)
    run(book, scores={"m0": 0.7, "m1": 0.5})
    assert book.get("m0").phase is Phase.FINISHED
    assert book.get("m0").queue[-1].result["done"] is True
    assert book.get("m1").phase is Phase.TRAINING


def test_stop_terms_read_tunes_stop_dict():
    assert stop_terms({"training_iteration": 10}) == (10, ())
    assert stop_terms({"training_iteration": 9.5, "val_accuracy": 0.9}) == (10, (("val_accuracy", 0.9),))
    assert stop_terms(None) == (None, ())
    assert stop_terms({"flag": True}) == (None, ())


def test_the_options_plan_of_a_stop_dict_speculates_to_its_cap():
    plan = BucketOptions().plan(stop_at=10, stop_criteria=(("val_accuracy", 0.99),))
    assert plan.budget == 10 and plan.speculate and not plan.bucket_decides
    assert plan.stop_criteria == (("val_accuracy", 0.99),)
    assert not BucketOptions(speculate=False).plan(stop_at=10).speculate


def test_the_options_plan_carries_the_runs_metric_where_tune_decides():
    plan = BucketOptions().plan(stop_at=10, rank=("val_loss", -1.0))
    assert (plan.metric, plan.sign) == ("val_loss", -1.0) and plan.speculate
    assert BucketOptions().plan(stop_at=10).metric is None


def test_a_runs_rank_is_its_metric_and_mode():
    assert rank_of("val_accuracy", "max") == ("val_accuracy", 1.0)
    assert rank_of("val_loss", "min") == ("val_loss", -1.0)
    assert rank_of(None, "max") is None and rank_of("val_loss", None) is None


def test_decision_points_seen_in_other_buckets_of_the_run_count_here():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    book.stops.seen_elsewhere({1: 3}, {1: 1})
    assert run_until_idle(book) == 1


def test_continues_seen_here_and_elsewhere_are_judged_together():
    stops = StopRecord(min_stop_rate=0.5)
    stops.seen_elsewhere({2: 1}, {})
    assert stops.points == (2,)
    stops.cont(2)
    stops.cont(2)
    assert stops.points == ()


def test_counts_of_several_buckets_add_up():
    assert sum_counts([{1: 2}, {1: 1, 4: 1}]) == {1: 3, 4: 1}


def test_held_members_ride_along_in_an_iteration_that_runs_anyway():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 3)
    book.stops.stop(1)
    run_until_idle(book)  # all at the point 1
    book.attach("m0")
    book.ask("m0")
    book.ask("m0")  # Tune continued m0: it needs iteration 2
    chosen, _ = book.next_iteration(0.0, ride=True)
    assert sorted(r.member for r in chosen) == ["m0", "m1", "m2"]
    chosen, _ = book.next_iteration(0.0, ride=False)
    assert [r.member for r in chosen] == ["m0"]


def test_riders_alone_never_start_an_iteration():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    book.stops.stop(1)
    run_until_idle(book)
    assert book.next_iteration(0.0, ride=True) == ([], None)


def test_nothing_rides_past_its_cap_or_without_one():
    book = book_with(Plan(run_ahead=2, speculate=True), 1)  # no cap known
    book.reserve("c", Plan(run_ahead=2, budget=1, speculate=True))
    book.place("c", slot=1, iteration=1)
    book.reserve("n", Plan(run_ahead=2, budget=10, speculate=True))
    book.place("n", slot=2, iteration=0)
    assert [r.member for r in book.riders([book.get("n")])] == []


def test_a_trial_stopped_before_the_cap_its_member_reached_teaches_a_point():
    book = book_with(Plan(run_ahead=2, budget=3, speculate=True), 1)
    book.attach("m0")
    run_until_idle(book)  # the member trained to its cap before its trial read anything
    assert book.ask("m0").iteration == 1
    book.leave("m0")  # Tune stopped it after 1
    assert book.stops.points == (1,)


def test_a_member_stopped_at_a_rung_by_its_bucket_teaches_nothing():
    plan = Plan(run_ahead=2, budget=8, bucket_decides=True, rungs=(1,), metric="val_loss", sign=-1.0)
    book = book_with(plan, 4)
    for i in range(4):
        book.attach(f"m{i}")
    run(book, scores={"m0": 0.1, "m1": 0.5, "m2": 0.6, "m3": 0.7})
    assert book.ask("m3").iteration == 1
    book.leave("m3")  # halved at the rung: its end was the bucket's
    assert book.stops.points == ()


# ----- evidence: what clears an iteration -------------------------------------------------------
def test_one_trial_continued_past_an_iteration_does_not_clear_it():
    # Stock ASHA continues a rung's first arrival whatever it scored.
    stops = StopRecord()
    stops.cont(1)
    assert not stops.clear(1, need=4) and stops.frontier(1, need=4) == 1


def test_an_iteration_is_clear_once_enough_trials_continued_past_it():
    stops = StopRecord()
    for _ in range(4):
        stops.cont(1)
    stops.cont(2)
    assert stops.clear(1, need=4) and stops.frontier(1, need=4) == 2


def test_a_learnt_decision_point_is_never_clear_however_many_continued():
    stops = StopRecord(min_stop_rate=0.1)
    stops.stop(1)
    for _ in range(5):
        stops.cont(1)
    assert stops.points == (1,) and not stops.clear(1, need=4)


def test_continues_seen_in_other_buckets_clear_an_iteration_here():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True, clear_after=4), 2)
    run_until_idle(book)
    clear_elsewhere(book, (1,), n=3)
    assert book.runnable() == []
    clear_elsewhere(book, (1,), n=4)
    assert {r.member for r in book.runnable()} == {"m0", "m1"}


def test_members_speculate_past_an_iteration_once_it_is_known_clear():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 3)
    book.stops.stop(5)  # the run stops trials somewhere: no computing past the evidence
    run_until_idle(book)
    clear_elsewhere(book, (1, 2, 3))
    run_until_idle(book)
    assert [book.get(f"m{i}").produced for i in range(3)] == [4, 4, 4]


def test_without_any_stop_seen_the_bucket_computes_one_iteration_past_the_evidence():
    # FIFO so far: the members train while the trials read, not after each read.
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    run_until_idle(book)
    clear_elsewhere(book, (1,))
    run_until_idle(book)
    assert [book.get(f"m{i}").produced for i in range(2)] == [3, 3]


def test_the_first_iteration_is_not_computed_past_before_its_evidence_even_without_a_stop():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    run_until_idle(book)
    clear_elsewhere(book, (1,), n=3)
    assert book.runnable() == []


def test_a_trial_continued_past_an_unclear_iteration_trains_its_member_there_and_no_further():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    run_until_idle(book)
    book.attach("m0")
    book.ask("m0")
    book.ask("m0")  # continued past 1: its trial asked for 2, nothing known of 2
    run_until_idle(book)
    assert book.get("m0").produced == 2 and book.get("m1").produced == 1


def test_a_plan_must_clear_an_iteration_on_at_least_one_continue():
    with pytest.raises(ValueError, match="clear_after"):
        Plan(clear_after=0)


# ----- holding: members that evidence may free are waited for, with a deadline ------------------
def _continued_past_1(n: int, gather_s: float = 1.0) -> MemberBook:
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), n, gather_s=gather_s)
    run_until_idle(book)
    book.attach("m0")
    book.ask("m0")
    book.ask("m0")  # Tune continued m0 past 1; m1.. wait for the run's evidence there
    return book


def test_an_iteration_waits_for_members_the_deciding_trials_may_yet_clear():
    book = _continued_past_1(3)
    assert book.next_iteration(0.0) == ([], 1.0)
    clear_elsewhere(book, (1,))
    chosen, wait = book.next_iteration(0.2)
    assert wait is None and sorted(r.member for r in chosen) == ["m0", "m1", "m2"]


def test_the_wait_for_evidence_ends_at_its_deadline():
    book = _continued_past_1(3)
    assert book.next_iteration(0.0) == ([], 1.0)
    chosen, wait = book.next_iteration(1.0)
    assert wait is None and [r.member for r in chosen] == ["m0"]
    book.started(chosen)
    assert book.get("m1").lagging  # not waited for again until it trains


def test_members_at_a_learnt_decision_point_are_not_waited_for():
    book = _continued_past_1(3)
    book.stops.stop(1)  # a trial stopped at 1: only its trials decide the rest there
    chosen, wait = book.next_iteration(0.0)
    assert wait is None and [r.member for r in chosen] == ["m0"]


# ----- whole sweeps, Tune's decisions simulated ------------------------------------------------
def fifo(member: str, iteration: int, score: float) -> bool:
    return True


def stock_asha(rungs=(1, 4), rf: float = 4.0):
    """Stock ASHA's rule (mode max): at a rung, continue iff the score is at
    least the (1 - 1/rf) percentile of every score recorded there so far."""
    recorded = {r: [] for r in rungs}

    def decide(member, iteration, score):
        if iteration not in recorded:
            return True
        recorded[iteration].append(score)
        values = sorted(recorded[iteration])
        q = (1 - 1 / rf) * (len(values) - 1)  # numpy's linear percentile
        lo = int(q)
        cutoff = values[lo] + (q - lo) * (values[min(lo + 1, len(values) - 1)] - values[lo])
        return score >= cutoff
    return decide


@dataclass
class Sweep:
    book: MemberBook
    lives: list[int]  # members each fused iteration trained
    stopped_early: int  # trials Tune stopped before the cap

    @property
    def trained(self) -> int:
        return sum(self.lives)


def sweep(decide, n: int = 16, cap: int = 10, in_flight: int = 4, seed: int = 0,
          clear_after: int = 4, staggered: bool = False, ordered: bool = False) -> Sweep:
    """``n`` members seated in one bucket, Tune running ``in_flight`` trials at
    once in seat order, deciding after each result. Tune reads faster than the
    bucket trains, or (``staggered``) the bucket trains whatever it may after
    each decision Tune makes. ``ordered``: the run's metric is known (the
    results carry the scores Tune decides on), so the read order applies
    (read_order.py); else the trials read in seat order."""
    import random

    draw = random.Random(seed)
    base = {f"m{i}": draw.random() for i in range(n)}

    def score(member: str, iteration: int) -> float:  # a member's own level, and noise per iteration
        return base[member] + 0.3 * random.Random(f"{seed}-{member}-{iteration}").random()

    rank = dict(metric="val_loss", sign=1.0) if ordered else {}  # run() puts the scores in val_loss
    book = book_with(Plan(run_ahead=2, budget=cap, speculate=True, clear_after=clear_after, **rank), n)
    clock = [0.0]
    book.clock = lambda: clock[0]

    def train() -> int:
        scores = {m: score(m, r.produced + 1) for m, r in book.records.items()}
        return len(run(book, scores, now=float(len(lives))))

    waiting, flying, lives, stopped = [f"m{i}" for i in range(n)], [], [], 0
    retried = False
    while waiting or flying:
        while waiting and len(flying) < in_flight:
            flying.append(waiting.pop(0))
            book.attach(flying[-1])
        moved = False
        for member in list(flying):
            entry = book.ask(member)
            if entry is None:
                if book.exhausted(member):
                    flying.remove(member)
                    book.leave(member)
                    moved = True
                continue
            moved = True
            if entry.iteration == cap:
                flying.remove(member)
                book.leave(member)
            elif not decide(member, entry.iteration, score(member, entry.iteration)):
                stopped += 1
                flying.remove(member)
                book.leave(member)
            if staggered and book.runnable():
                lives.append(train())
        if not moved and book.held_until and not retried:
            retried = True  # a held trial reads once the read it waited for was decided (the bucket asks again)
            continue
        retried = False
        if not moved:
            if book.held_until and not book.runnable():
                clock[0] = max(book.held_until.values())  # a held read's wait ends
                continue
            assert book.runnable(), "the sweep stalled"
            lives.append(train())
    return Sweep(book, lives, stopped)


def test_a_fifo_sweep_trains_every_member_in_every_fused_iteration_and_wastes_nothing():
    result = sweep(fifo)
    assert result.book.wasted == 0
    assert result.lives == [16] * 10


def test_under_stock_asha_members_wait_at_its_first_rung_when_one_of_its_first_trials_is_stopped():
    result = sweep(stock_asha(), n=32, seed=0)
    assert result.stopped_early > 0 and result.book.wasted == 0
    assert result.lives[0] == 32  # every member's first iteration, in one fused iteration
    assert result.book.stops.points == (1, 4)


@pytest.mark.parametrize("staggered", [False, True], ids=["tune_reads_first", "bucket_trains_between_reads"])
def test_under_stock_asha_waste_is_rare_and_always_within_the_bound(staggered):
    # Speculation passes a rung only where its first clear_after arrivals all
    # continued (stock ASHA continues the k-th only if it is the best so far).
    results = [sweep(stock_asha(), n=32, seed=seed, staggered=staggered) for seed in range(60)]
    wasteful = [r for r in results if r.book.wasted > 0.1 * r.trained]
    assert len(wasteful) <= 0.1 * len(results)
    assert sum(r.book.wasted for r in results) <= 0.1 * sum(r.trained for r in results)
    for r in results:  # The guide's bound (how-a-sweep-runs.md): a trial stopped at t wastes at most cap - t
        assert r.book.wasted <= r.stopped_early * (10 - 1)


@pytest.mark.parametrize("rungs, rf", [((1, 4), 4.0), ((1, 2, 4, 8), 2.0)], ids=["rf4", "rf2"])
def test_with_the_runs_metric_known_stock_asha_never_trains_past_its_first_rung_for_nothing(rungs, rf):
    # The read order (read_order.py) makes the run's first arrivals at a rung
    # a pair ASHA decides on rank. In seat order, 300 seeds: rf 4 wasted 3.9%
    # (8 runs over 10%), rf 2 12.5% (45 runs); ordered 0.0% and 0.1% (0 and 1).
    results = [sweep(stock_asha(rungs=rungs, rf=rf), n=32, seed=seed, ordered=True) for seed in range(100)]
    assert sum(r.book.wasted for r in results) <= 0.01 * sum(r.trained for r in results)
    assert sum(r.book.wasted > 0.1 * r.trained for r in results) <= 1


def test_the_read_order_leaves_a_fifo_sweep_fully_fused():
    for seed in range(30):
        result = sweep(fifo, n=32, seed=seed, ordered=True)
        assert result.lives == [32] * 10 and result.book.wasted == 0


def test_a_continue_that_may_clear_an_iteration_is_news_for_the_runs_other_buckets():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 1)
    run(book)
    book.attach("m0")
    book.ask("m0")
    assert not book.news  # its first read: nothing decided yet
    book.ask("m0")  # continued past 1
    assert book.news


def test_a_continue_past_an_iteration_already_clear_is_no_news():
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 1)
    run(book)
    clear_elsewhere(book, (1,), n=4)
    book.attach("m0")
    book.ask("m0")
    book.ask("m0")
    assert not book.news


def test_once_the_run_stops_trials_a_continued_member_runs_ahead_of_its_trial_by_run_ahead():
    # A survivor of a rung: only its own trial reads what it computes ahead,
    # so a stop there wastes run_ahead at most; never past a learnt point.
    book = book_with(Plan(run_ahead=2, budget=10, speculate=True), 2)
    book.stops.stop(1)
    book.stops.stop(4)
    run_until_idle(book)
    for member in ("m0", "m1"):
        book.attach(member)
        book.ask(member)
    book.ask("m0")  # continued past 1: asks for 2
    run_until_idle(book)
    assert book.get("m0").produced == 4  # 2 + run_ahead, and the point 4
    book.ask("m0")
    book.ask("m0")
    book.ask("m0")
    assert book.ask("m0") is None  # continued past 4: asks for 5
    run_until_idle(book)
    assert book.get("m0").produced == 7 and book.get("m1").produced == 1
