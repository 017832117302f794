"""Survivors regroup: a Ray-free simulation of a ChorusASHA sweep's buckets, with and without regrouping.

It drives the project's own rules, not copies of them: ``Placement`` (which
bucket a member goes to, refills), ``MemberBook`` (who trains, the cohort
rule at rungs) and ``regrouping.plan_regroup`` (who moves where), moving
members as the pool and the bucket actors do (``MemberBook.move_out``, a
reserve and place in the new bucket carrying the cohort token). What it
does not model: training itself (a member's score at a rung is a fixed
pseudo-random number), time (one tick is one fused iteration of every bucket
that has a member to train), and Tune beyond ChorusASHA's own rule (a trial
reads every result at once; a member held alone at a rung is decided by
``CohortBracket``, against everything recorded at that rung). Seats arrive as ChorusSearch
makes them: ``lookahead`` at once, then ``seats_per_tick``.

    python benchmarks/regroup_sim.py --trials 128 --seats-per-tick 0.5

prints the mean members trained per fused iteration (``chorus/live``) with
and without regrouping. It also checks, as it goes, that every cohort
halved at a rung after the first is made of survivors of one earlier
cohort: regrouping never changes who is compared with whom.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
from dataclasses import dataclass, field

from chorus_tune.tune.rules.halving import STOP, CohortBracket
from chorus_tune.tune.rules.members import MemberBook, Phase
from chorus_tune.tune.rules.placement import Placement
from chorus_tune.tune.rules.regrouping import BucketView, member_view, plan_regroup
from chorus_tune.tune.values.plan import Plan


def score(member: str, iteration: int) -> float:
    """A fixed pseudo-random score in [0, 1) for ``member`` at ``iteration``."""
    digest = hashlib.sha256(f"{member}@{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class Outcome:
    lives: list[int] = field(default_factory=list)  # members trained, per fused iteration
    cohorts: list[tuple[int, frozenset[str]]] = field(default_factory=list)  # (rung, members) halved together
    moves: int = 0
    moved_members: int = 0
    member_iterations: int = 0

    @property
    def mean_live(self) -> float:
        return statistics.mean(self.lives) if self.lives else 0.0


class Sim:
    """Buckets of one structure, filled and regrouped by the project's rules."""

    def __init__(self, capacity: int, max_buckets: int, plan: Plan, regroup: bool, grace_period: int = 1):
        self.capacity, self.plan, self.regroup = capacity, plan, regroup
        self.bracket = CohortBracket(grace_period, plan.budget, plan.reduction_factor)
        self.placement = Placement(max_buckets)
        self.books: dict[str, MemberBook] = {}
        self.free: dict[str, set[int]] = {}
        self.out = Outcome()
        self.tokens = 0
        self._stopped: set[str] = set()  # held alone at a rung, and stopped there

    def seat(self, member: str) -> None:
        placed = self.placement.request(member, "key", self.capacity)
        if placed is not None:
            self._place(member, placed.bucket)

    def _place(self, member: str, bucket: str, iteration: int = 0, cohort: str | None = None,
               held_at: int | None = None) -> None:
        if bucket not in self.books:
            self.books[bucket] = MemberBook(max_queue=10_000, gather_s=0.0)
            self.free[bucket] = set(range(self.capacity))
        book = self.books[bucket]
        book.reserve(member, self.plan)
        slot = min(self.free[bucket])
        self.free[bucket].discard(slot)
        book.place(member, slot, iteration, held_at=held_at)
        book.get(member).cohort = cohort

    def tick(self) -> bool:
        """One fused iteration of every bucket with a member to train; whether any trained."""
        trained = False
        for name, book in list(self.books.items()):
            chosen, _ = book.next_iteration(0.0, gather=False)
            if not chosen:
                continue
            trained = True
            outputs = {r.member: ({"score": score(r.member, r.produced + 1)}, None) for r in chosen}
            self.out.lives.append(len(chosen))
            self.out.member_iterations += len(chosen)
            for slot in book.record(outputs):
                self.free[name].add(slot)
            self._note_cohorts(book, outputs)
            self._read_all(name, book)
        if self.regroup:
            self._regroup()
        return trained

    def _note_cohorts(self, book: MemberBook, outputs: dict) -> None:
        seen: dict[tuple, set[str]] = {}
        for member in outputs:
            entry = book.get(member).queue[-1]
            decision = entry.result.get("chorus/decision")
            if decision == "HELD":
                # Alone at its rung: ChorusASHA decides it as plain ASHA would, against the rung's record.
                if self.bracket.on_result(member, entry.iteration, entry.result["score"]) == STOP:
                    self._stopped.add(member)
            elif decision in ("CONTINUE", "STOP"):
                self.bracket.record(member, entry.iteration, entry.result["score"])
                key = (entry.iteration, entry.result.get("chorus/cohort"))
                seen.setdefault(key, set()).add(member)
        self.out.cohorts.extend((rung, frozenset(members)) for (rung, _), members in seen.items())

    def _read_all(self, name: str, book: MemberBook) -> None:
        # Every trial reads at once: one continued goes on, one stopped leaves.
        for record in list(book.records.values()):
            if record.phase in (Phase.LEFT, Phase.FAILED):
                continue
            while book.ask(record.member) is not None:
                pass
            if record.member in self._stopped or (record.phase is Phase.FINISHED and not record.queue):
                slot = book.leave(record.member)
                if slot is not None:
                    self.free[name].add(slot)
                update = self.placement.remove(record.member)
                for placed in update.placed:
                    self._place(placed.trial_id, placed.bucket)

    def _regroup(self) -> None:
        views = []
        for name, record in self.placement.buckets.items():
            book = self.books.get(name)
            if book is None or not record.members:
                continue
            views.append(BucketView(name, self.capacity,
                                    tuple(member_view(r, book.limit(r)) for r in book.in_slots())))
        for move in plan_regroup(views, self.placement.waiting_for("key")):
            self.placement.begin_move(move.source, move.dest)
            source = self.books[move.source]
            for unit in move.units:
                self.tokens += 1
                token = unit.carries(f"{move.source}/{self.tokens}")
                for member in unit.members:
                    record = source.get(member)
                    produced = record.produced
                    held_at = record.hold_at if record.phase is Phase.HELD else None  # as take_out
                    self.free[move.source].add(source.move_out(member))
                    source.leave(member)  # every result was read (_read_all)
                    self.placement.move([member], move.source, move.dest)
                    self._place(member, move.dest, produced, token, held_at)
            self.placement.end_move(move.source, move.dest)
            self.out.moves += 1
            self.out.moved_members += len(move.members)


def simulate(trials: int = 128, capacity: int = 16, max_buckets: int = 2, max_t: int = 16,
             rungs: tuple[int, ...] = (1, 4), reduction_factor: float = 4.0, regroup: bool = True,
             lookahead: int | None = None, seats_per_tick: float = 0.5) -> Outcome:
    """Run the sweep to its end; ``lookahead``: seats at once (default, as ChorusSearch:
    a bucket more than the budget holds), then ``seats_per_tick`` (Tune's pace of trials)."""
    plan = Plan(budget=max_t, bucket_decides=True, rungs=rungs, reduction_factor=reduction_factor,
                metric="score", sign=1.0)
    sim = Sim(capacity, max_buckets, plan, regroup)
    lookahead = capacity * (max_buckets + 1) if lookahead is None else lookahead
    seated, credit = 0, 0.0
    for _ in range(min(lookahead, trials)):
        sim.seat(f"m{seated:04d}")
        seated += 1
    for _ in range(100_000):
        credit += seats_per_tick
        while credit >= 1 and seated < trials:
            sim.seat(f"m{seated:04d}")
            seated, credit = seated + 1, credit - 1
        if not sim.tick() and seated >= trials and not any(sim.placement.buckets[n].members
                                                           for n in sim.placement.buckets):
            break
    return sim.out


def lineage_holds(outcome: Outcome, first_rung: int) -> bool:
    """Whether every cohort halved after ``first_rung`` is made of survivors of one earlier cohort."""
    earlier: dict[str, frozenset[str]] = {}
    for rung, members in outcome.cohorts:
        if rung != first_rung:
            parents = {earlier.get(m) for m in members}
            if len(parents) != 1 or None in parents:
                return False
        for m in members:
            earlier[m] = members
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=128)
    parser.add_argument("--bucket-size", type=int, default=16)
    parser.add_argument("--max-buckets", type=int, default=2)
    parser.add_argument("--max-t", type=int, default=16)
    parser.add_argument("--seats-per-tick", type=float, default=0.5)
    parser.add_argument("--lookahead", type=int, default=None, help="seats at once (default: ChorusSearch's)")
    args = parser.parse_args()
    for regroup in (False, True):
        out = simulate(args.trials, args.bucket_size, args.max_buckets, args.max_t, regroup=regroup,
                       lookahead=args.lookahead, seats_per_tick=args.seats_per_tick)
        print(f"regroup={regroup}: mean live {out.mean_live:.1f} of {args.bucket_size} over {len(out.lives)} fused "
              f"iterations, {out.member_iterations} member-iterations, {out.moves} moves "
              f"({out.moved_members} members), cohorts kept apart: {lineage_holds(out, 1)}")


if __name__ == "__main__":
    main()
