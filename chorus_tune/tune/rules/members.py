"""Who trains next, how far ahead, and what each trial reads (Ray-free).

The bucket is the executor and Tune keeps the ledger (docs/design.md D4): a
bucket trains its members as fast as the device allows, each member's results
wait in a queue, and its trial's ``step`` takes the next one. This module holds
every rule of that, one :class:`MemberRecord` per member with an explicit
:class:`Phase`, so the bucket actor is a thin adapter over :class:`MemberBook`
and the rules are tested directly, fast.

How far a member may run ahead of its trial (its *limit*, an iteration number):

* **Decisions the bucket knows** (``Plan.bucket_decides``: ChorusASHA's rungs
  and ``max_t``, or an iteration budget the user gave): up to the budget. At a
  rung, the members that reach it in the same fused iteration form a cohort
  and are halved there, as synchronous successive halving would (the rule of
  :mod:`chorus_tune.tune.rules.halving`); the stopped go no further, the survivors
  go on at once. A member that reaches a rung alone is HELD there until its
  trial asks past it (Tune's scheduler continued it).
* **Decisions only Tune makes** (Tune's default FIFO scheduler, stock ASHA,
  HyperBand, median stopping, PBT, stoppers): the bucket cannot tell a FIFO run
  from one that stops trials early, so it *speculates on evidence*
  (``Plan.speculate``): every member trains to iteration 1 (every trial Tune
  starts reads it), and past what its trial asked for no further than the
  first iteration not *known clear* (:meth:`StopRecord.frontier`): one fewer
  than ``Plan.clear_after`` of the run's trials were seen continued past, or
  a *learned decision point* (:class:`StopRecord`: Tune was seen stopping
  trials there). Under FIFO the trials in flight clear every iteration, and
  while nothing was stopped the bucket computes one iteration past the
  evidence, so members train at full fusion and nothing is wasted; under
  stock ASHA members wait at its first rung for its trials' decisions. Once
  the run stops trials, a member whose trial was continued past a decision
  runs up to ``run_ahead`` past its ask (never past a learned point). Without
  a cap (a stop dict's ``training_iteration``), a member runs to a learned
  point ahead, else at most ``run_ahead`` beyond what its trial asked for.
  ``speculate=False`` keeps that ``run_ahead`` bound everywhere (a stopped
  trial then wastes at most ``run_ahead``); ``run_ahead=0`` is strict lockstep:
  an iteration is computed only once its trial asked for it.
* **Stop criteria on the member's own metrics** (``stop={"val_accuracy": 0.95}``):
  Tune stops a trial at its first result with ``result[key] >= value``; the
  bucket checks the same on each result it computes and trains that member
  no further (its result is ``done``).
* Never more than ``max_queue`` results queued (each holds a state snapshot,
  so a checkpoint after result *t* restores the member exactly at *t*): this
  bounds the memory run-ahead costs.

Wasted member-iterations (computed, then never read because the trial left
first) are counted per member and in total.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable

from chorus_tune.tune.rules.halving import CONTINUE, STOP, select_survivors
from chorus_tune.tune.rules.member_record import IN_SLOT, Entry, MemberRecord, Phase
from chorus_tune.tune.rules.read_order import ReadOrder
from chorus_tune.tune.rules.run_ahead import hard_limit, member_limit
from chorus_tune.tune.rules.stop_record import StopRecord
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.plan import Plan

# The book and the values it hands out (a record's phase, a queued entry, the
# run's stop evidence) are imported from here; each value lives in its own module.
__all__ = ["IN_SLOT", "Entry", "MemberBook", "MemberRecord", "Phase", "StopRecord", "meets_stop_criteria"]


class MemberBook:
    """The members of one bucket and the rules that move them.

    ``max_queue``: at most this many results wait per member (the memory bound
    of running ahead). ``gather_s``: an iteration waits this long for members
    whose trial is about to ask, or whose next iteration the run's trials
    deciding now may clear (so trials in step with each other, and members
    continued together, train in one fused iteration), never for a member
    left out last time.
    """

    def __init__(self, max_queue: int = 64, gather_s: float = 0.05, hold_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1; got {max_queue}")
        self.max_queue = max_queue
        self.gather_s = gather_s
        self.clock = clock
        # Who reads first where several trials wait at an iteration Tune has not settled (read_order.py).
        self.read_order = ReadOrder(hold_s)
        # Members whose waiting trial is held back by that order: when to ask again, at the latest.
        self.held_until: dict[str, float] = {}
        self.records: dict[str, MemberRecord] = {}
        self.wasted = 0
        self.stops = StopRecord()
        # A stop, or a continue, the run's other buckets have not heard of and
        # that may change what they know (the bucket actor sends its counts,
        # then clears it).
        self.news = False
        self._ready_since: float | None = None
        # Members the pool has placed here to refill freed slots, on their way
        # (not yet expected), each with when the next iteration stops waiting for it.
        self._refills: dict[str, float] = {}

    # ----- membership -------------------------------------------------------------------------------
    def reserve(self, member: str, plan: Plan) -> MemberRecord:
        """Hold a place for ``member`` (idempotent while it is reserved or in a slot)."""
        record = self.records.get(member)
        if record is not None and record.phase in (Phase.RESERVED, *IN_SLOT):
            return record
        record = MemberRecord(member, plan)
        self.records[member] = record
        return record

    def place(self, member: str, slot: int, iteration: int, state: Any = None,
              held_at: int | None = None) -> MemberRecord:
        """``member`` is built into ``slot`` at its ``iteration`` (0, or where its state was).
        ``held_at``: it was HELD alone at that rung in the bucket it moved from
        (regrouping.py), and stays held here until its trial asks beyond it."""
        record = self._get(member)
        if record.phase is not Phase.RESERVED:
            raise ValueError(f"member {member} is {record.phase.value}, not reserved")
        if held_at is not None and held_at != iteration:
            raise ValueError(f"member {member} is held at iteration {held_at}, but its state is at {iteration}")
        record.phase, record.slot, record.building, record.lagging = Phase.TRAINING, slot, False, False
        record.produced = record.asked = record.taken = iteration
        record.state_at_taken = state
        if held_at is not None:
            record.phase, record.hold_at = Phase.HELD, held_at
        return record

    def fail(self, member: str, error: BaseException) -> None:
        record = self._get(member)
        record.phase, record.error, record.slot, record.building = Phase.FAILED, error, None, False

    def set_plan(self, member: str, plan: Plan) -> None:
        self._get(member).plan = plan

    def attach(self, member: str) -> None:
        self._get(member).attached = True

    def leave(self, member: str) -> int | None:
        """``member``'s trial is gone: returns the slot to free, if it held one.
        What it computed and nobody read is counted as wasted. Idempotent."""
        record = self.records.get(member)
        if record is None or record.phase is Phase.LEFT:
            return None
        slot = record.slot if record.in_slot else None
        self.count_stop(member)
        if record.phase is not Phase.FAILED:
            wasted = record.produced - record.taken
            record.wasted += wasted
            self.wasted += wasted
        record.queue.clear()
        self.held_until.pop(member, None)
        # Its last state goes too: the bucket keeps a few of those, bounded,
        # for a late save; a record of each member that ever left must not.
        record.state_at_taken = None
        record.phase, record.slot = Phase.LEFT, None
        return slot

    def count_stop(self, member: str) -> bool:
        """Count the stop that ``member``'s trial leaving now means, once:
        its trial left before the end the bucket knew of (its cap, a rung, a
        criterion), even if the member had trained that far already, so Tune
        stopped it after its last result (a stopper, a scheduler). Called by
        :meth:`leave`, and by the bucket as soon as a leave arrives: a leave
        waits for the running iteration to free the slot, while the continues
        of other trials count at once, and a stop counted only after the
        iteration let their continues clear the point first (docs/design.md
        D4). Whether it counted one now."""
        record = self.records.get(member)
        if (record is None or record.phase in (Phase.LEFT, Phase.FAILED) or record.stop_counted
                or not record.attached or record.taken < 1
                or (record.final is not None and record.taken >= record.final)):
            return False
        record.stop_counted = True
        self.stops.stop(record.taken)
        self.news = True  # the run's other buckets learn it too
        return True

    def move_out(self, member: str) -> int:
        """``member`` goes on training in another bucket (regrouping.py): it
        trains here no more and frees its slot (returned); the results it has
        queued stay, for its trial to read first. Nothing it computed is
        wasted, and its trial's leave is no stop of Tune's."""
        record = self._get(member)
        if not record.in_slot:
            raise ValueError(f"member {member} is {record.phase.value}, not in a slot")
        return self._finish(record)

    def renumber(self, remap: dict[int, int]) -> None:
        """Slots after a compaction: ``{old: new}``."""
        for record in self.records.values():
            if record.in_slot:
                record.slot = remap[record.slot]

    # ----- views ------------------------------------------------------------------------------------
    def get(self, member: str) -> MemberRecord | None:
        return self.records.get(member)

    def in_slots(self) -> list[MemberRecord]:
        return [r for r in self.records.values() if r.in_slot]

    def reserved(self) -> list[str]:
        return [m for m, r in self.records.items() if r.phase is Phase.RESERVED]

    def limit(self, record: MemberRecord) -> float:
        """The iteration ``record`` may be computed up to now (rules/run_ahead.py)."""
        return member_limit(record, self.stops, self.max_queue)

    def runnable(self) -> list[MemberRecord]:
        return [r for r in self.in_slots() if r.phase is Phase.TRAINING and r.produced < self.limit(r)]

    def _about_to_ask(self, record: MemberRecord) -> bool:
        if record.lagging:
            return False
        if record.phase is Phase.RESERVED:
            # Placed for a trial that Tune has just started: its first request
            # (which builds it) is moments away; trials started together then
            # train together from their first iteration.
            return not record.building
        if (record.phase is not Phase.TRAINING or record.produced < self.limit(record)
                or (record.plan.budget is not None and record.produced >= record.plan.budget)):
            return False
        # Blocked only because its (live, keeping-up) trial has not asked yet,
        # or only for want of evidence: the run's trials deciding the iteration
        # it waits at may continue them, clearing it (never at a learnt point).
        return record.attached or self._awaits_evidence(record)

    def _awaits_evidence(self, record: MemberRecord) -> bool:
        """A speculating member stopped at an iteration that is neither known
        clear nor a learnt decision point: more continues there would free it."""
        plan = record.plan
        return (plan.speculate and not plan.bucket_decides and plan.run_ahead > 0
                and plan.budget is not None and record.hold_at is None
                and self.stops.next_point(record.produced) != record.produced)

    def riders(self, chosen: list[MemberRecord]) -> list[MemberRecord]:
        """Members that may ride along in an iteration that runs anyway: held
        back only at a decision point or for want of evidence (their trial's
        decision is Tune's and not made yet), still short of their cap. Where the fused step
        computes every row of the stack, masked or not, a rider costs nothing
        but its result's snapshot; if Tune then stops its trial at the point,
        what it rode is wasted (at most cap - point iterations, counted)."""
        picked = {r.member for r in chosen}
        out = []
        for record in self.in_slots():
            plan = record.plan
            if (record.member in picked or record.phase is not Phase.TRAINING or not plan.speculate
                    or plan.bucket_decides or plan.run_ahead == 0 or plan.budget is None):
                continue
            if record.produced < hard_limit(record, self.max_queue):
                out.append(record)
        return out

    def next_iteration(self, now: float, gather: bool = True,
                       ride: bool = False) -> tuple[list[MemberRecord], float | None]:
        """Who trains in the next fused iteration, or how long to wait first.

        Returns ``(members, None)`` to run now, ``([], seconds)`` to look again
        after ``seconds`` (gathering), ``([], None)`` when nobody can train.
        ``gather=False``: who may train now, without waiting for anyone.
        ``ride``: an iteration that runs takes its :meth:`riders` along (say so
        when a masked row costs as much as a trained one).
        """
        runnable = self.runnable()
        if not runnable:
            self._ready_since = None
            return [], None
        if any(r.building for r in self.records.values()):
            # Members being built join this iteration: a cohort seated together
            # reaches its rungs together.
            return [], None
        refill_s = self._refill_wait(now)
        if gather and refill_s > 0:
            return [], refill_s
        if self._ready_since is None:
            self._ready_since = now
        waiting_for = [r for r in self.records.values() if self._about_to_ask(r)]
        remaining = self._ready_since + self.gather_s - now
        if gather and waiting_for and remaining > 0:
            return [], remaining
        return (runnable + self.riders(runnable) if ride else runnable), None

    def expect_refill(self, members: Iterable[str], until: float) -> None:
        """The pool placed ``members`` here, into slots this bucket freed: the
        next iteration waits for them until ``until`` (a time on
        :meth:`next_iteration`'s clock), so that they train with the members
        in slots instead of an iteration later. Why: under ChorusASHA a cohort
        halved at a rung frees its slots at an iteration's end, and the next
        iteration started with the survivors alone before the refill arrived;
        the iterations alternated 16 and 7 members wide (128 trials, buckets
        of 16, one run's logs). Waiting for a member already here, or past
        ``until``, ends at once (every wait ends)."""
        for member in members:
            if member not in self.records or self.records[member].phase is Phase.LEFT:
                self._refills[member] = until

    def _refill_wait(self, now: float) -> float:
        """Seconds the next iteration still waits for refills on their way (0: none)."""
        for member, until in list(self._refills.items()):
            record = self.records.get(member)
            if until <= now or (record is not None and record.phase is not Phase.LEFT):
                del self._refills[member]  # arrived, or waited for long enough
        return max((until - now for until in self._refills.values()), default=0.0)

    def started(self, trained: Iterable[MemberRecord]) -> None:
        """An iteration starts with ``trained``: members left out while their
        trial was behind are lagging (never waited for, until they catch up)."""
        self._ready_since = None
        chosen = {r.member for r in trained}
        for record in self.records.values():
            if record.member in chosen:
                record.lagging = False
            elif self._about_to_ask(record):
                record.lagging = True

    # ----- results ----------------------------------------------------------------------------------
    def record(self, outputs: dict[str, tuple[dict[str, Any], Any]]) -> list[int]:
        """The results of one fused iteration: ``{member: (result, state)}``.

        Queues each result with its state, halves cohorts at rungs, finishes
        members at their budget. Returns the slots freed (members that train
        no more)."""
        reached: dict[tuple, list[MemberRecord]] = {}
        for member, (result, state) in outputs.items():
            record = self._get(member)
            record.produced += 1
            record.queue.append(Entry(record.produced, result, state))
            plan = record.plan
            if plan.bucket_decides and record.produced in plan.rungs and record.produced != plan.budget:
                reached.setdefault((record.produced, plan, record.cohort), []).append(record)
        for (rung, plan, _), cohort in reached.items():
            self._decide(rung, plan, cohort)
        freed = []
        for member in outputs:
            record = self._get(member)
            budget = record.plan.budget
            if record.phase is Phase.TRAINING and meets_stop_criteria(record.plan, record.queue[-1].result):
                # Tune stops the trial at this result: nothing past it is read.
                record.queue[-1].result["done"] = True
                freed.append(self._finish(record))
            elif record.phase is Phase.TRAINING and budget is not None and record.produced >= budget:
                record.queue[-1].result["done"] = True
                freed.append(self._finish(record))
            elif record.phase is Phase.FINISHED and record.slot is not None:
                freed.append(self._finish(record))
        return freed

    def _decide(self, rung: int, plan: Plan, cohort: list[MemberRecord]) -> None:
        entries = {r.member: r.queue[-1] for r in cohort}
        if cohort[0].cohort is not None:
            for entry in entries.values():
                entry.result[rk.COHORT] = cohort[0].cohort  # moved in: halved with its own cohort only
        if len(cohort) == 1:
            record = cohort[0]
            record.phase, record.hold_at = Phase.HELD, rung
            entries[record.member].result[rk.DECISION] = rk.HELD
            entries[record.member].result[rk.COHORT_SIZE] = 1
            return
        scores = {}
        for member, entry in entries.items():
            raw = entry.result.get(plan.metric)
            value = math.nan if raw is None else plan.sign * float(raw)
            scores[member] = value
        ranked = sorted(scores, key=lambda m: (math.isnan(scores[m]), -scores[m] if not math.isnan(scores[m])
                                               else 0.0, m))
        keep = set(select_survivors(scores, plan.reduction_factor))
        for rank, member in enumerate(ranked, start=1):
            result = entries[member].result
            result[rk.DECISION] = CONTINUE if member in keep else STOP
            result[rk.COHORT_SIZE] = len(cohort)
            result[rk.COHORT_RANK] = rank
            if member not in keep:
                self._get(member).phase = Phase.FINISHED

    def _finish(self, record: MemberRecord) -> int:
        slot = record.slot
        record.phase, record.slot, record.final = Phase.FINISHED, None, record.produced
        return slot

    # ----- what trials read -------------------------------------------------------------------------
    def ask(self, member: str, ordered: bool = True) -> Entry | None:
        """``member``'s trial asks for its next result: the result if one is
        ready (delivered now), else ``None`` (it waits; the ask counts).
        ``ordered``: as for :meth:`deliver`."""
        record = self._get(member)
        if record.phase is Phase.FAILED:
            raise record.error
        if record.phase is Phase.LEFT:
            raise KeyError(f"member {member} has left this bucket")
        if record.asked == record.taken:
            if record.taken >= 1:
                self.stops.cont(record.taken)  # Tune let it past its last result
                if (self.stops.continues(record.taken) <= record.plan.clear_after
                        or self.stops.stopped_at(record.taken)):
                    self.news = True  # it may clear the iteration (or unlearn a point) in other buckets too
            record.asked += 1
        if record.hold_at is not None and record.asked > record.hold_at:
            # Tune continued a member held alone at a rung.
            record.hold_at = None
            if record.phase is Phase.HELD:
                record.phase = Phase.TRAINING
        return self.deliver(member, ordered)

    def deliver(self, member: str, ordered: bool = True) -> Entry | None:
        """The next result of a member whose trial is waiting for it, if computed
        and its turn (``ordered``: the read order of read_order.py applies; a
        result the trial fetched already is replayed unordered)."""
        record = self._get(member)
        if record.asked <= record.taken or not record.queue:
            return None
        if ordered and self._held(record):
            return None
        self.held_until.pop(member, None)
        entry = record.queue.popleft()
        record.taken = entry.iteration
        record.state_at_taken = entry.state
        return entry

    def read_to(self, member: str, iteration: int | None) -> None:
        """``member``'s trial has handed Tune every result up to ``iteration``.
        A trial fetches the results queued here in one call and returns them
        from its own buffer (docs/design.md D3), so the queue keeps them, with
        their states, until the trial says how far Tune read: at its next
        fetch, a save and its leave. Each is delivered now as the trial's
        per-result asks would have, so what the book learns (continued at
        each, the state a save reads, the waste and the stop at a leave) is
        the same. ``None``, or an iteration read already: nothing to do."""
        record = self._get(member)
        if iteration is None or record.phase is Phase.LEFT:
            return
        while record.taken < iteration and record.queue and record.queue[0].iteration <= iteration:
            if record.phase is Phase.FAILED:
                # Its results computed before it failed were read (its trial hears
                # the error at its next fetch); ask would raise that error here.
                record.asked = max(record.asked, record.taken + 1)
                self.deliver(member, ordered=False)
            elif self.ask(member, ordered=False) is None:
                break

    def _held(self, record: MemberRecord) -> bool:
        """Whether ``record``'s waiting trial reads after another's at an
        iteration Tune has not settled (read_order.py); notes until when."""
        plan, entry = record.plan, record.queue[0]
        iteration = entry.iteration
        if (plan.metric is None or not plan.speculate or plan.bucket_decides
                or not self.read_order.pending(iteration) or self.stops.any_stopped
                or (plan.budget is not None and iteration >= plan.budget)  # nothing trains past it
                or self.stops.clear(iteration, plan.clear_after)):
            return False
        rivals = {r.member: _score(r.plan, r.queue[0].result) for r in self.records.values()
                  if r is not record and r.phase not in _GONE and r.asked > r.taken and r.queue
                  and r.queue[0].iteration == iteration}
        now = self.clock()
        wait = self.read_order.hold(record.member, iteration, _score(plan, entry.result), rivals,
                                    lambda m: self._decided(m, iteration), now)
        if wait is None:
            return False
        self.held_until[record.member] = now + wait
        return True

    def _decided(self, member: str, iteration: int) -> bool:
        """Whether Tune's decision on ``member``'s result at ``iteration`` reached the bucket
        (its trial asked past it, or left), or will not soon: its trial fetched
        results past it too, and asks again only once Tune has read those."""
        record = self.records.get(member)
        return (record is None or record.phase in _GONE or record.stop_counted
                or record.asked > iteration or bool(record.queue))

    def exhausted(self, member: str) -> bool:
        """The member's trial asks for more than it will ever get (it finished)."""
        record = self._get(member)
        return record.phase is Phase.FINISHED and not record.queue and record.asked > record.taken

    def _get(self, member: str) -> MemberRecord:
        record = self.records.get(member)
        if record is None:
            raise KeyError(f"no member {member} in this bucket")
        return record


_GONE = (Phase.LEFT, Phase.FAILED)


def _score(plan: Plan, result: dict[str, Any]) -> float:
    """A result's metric, higher is better; a missing or NaN one ranks last."""
    raw = result.get(plan.metric)
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or math.isnan(raw):
        return -math.inf
    return plan.sign * float(raw)


def meets_stop_criteria(plan: Plan, result: dict[str, Any]) -> bool:
    """Tune's ``Trial.should_stop`` for the criteria a member's result carries."""
    for key, value in plan.stop_criteria:
        got = result.get(key)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and got >= value:
            return True
    return False
