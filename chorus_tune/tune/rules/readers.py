"""Which member each trial reads (Ray-free; the pool actor keeps one :class:`Readers`).

A trial reads one member: a member ChorusSearch seated for it before Tune
created the trial (bound to it by :meth:`Readers.bind`), or one of its own,
named by its trial id. Each reservation gets a token, so that a late call
from an actor that served an earlier run of the trial (a restart, a restore
in this job) is told apart from the current one's.
"""
from __future__ import annotations

import random
from typing import Callable

Known = Callable[[str], bool]  # a test on a member name


class Readers:
    """Trials bound to seated members, and the member each trial reads now."""

    def __init__(self, seed: int = 0) -> None:
        self.bound: dict[str, str] = {}  # trial id -> the seated member ChorusSearch gave it
        self.reading: dict[str, tuple[str, int]] = {}  # trial id -> (member it reads now, reservation token)
        self._tokens = 0
        self._rng = random.Random(seed)  # which placed member a trial reads (bind says why)

    def bind(self, trial_id: str, candidates: list[str], seated: Known, placed: Known,
             slotted: Known | None = None, solo: Known | None = None) -> str | None:
        """Bind ``trial_id`` to one of ``candidates`` that is ``seated``: a
        ``placed`` one (its bucket expects it), drawn at random (seeded); else,
        drawn the same way, a ``slotted`` one (it has a slot in a bucket that is
        still starting); else the oldest one still waiting for a slot. So the
        trials Tune runs read results that exist, or soon will. For a trial that
        reads already: the candidate it reads, or ``None`` when it reads another
        member (its own). ``None`` too when no candidate is seated.

        Why at random among the placed (docs/design.md D10, measured there):
        taken oldest first, a grid's first trials are its first points in
        order, all seated in the first bucket. A grid of ascending learning
        rates then reached stock ASHA's first rung each better than the last,
        so ASHA continued them all, which is what FIFO shows (D4, "Where the
        evidence rule fails"); and the trials Tune runs read one bucket while
        the other waited. Drawn at random, the run's first results came
        sooner and its wall time was no worse, with fewer members a fused
        iteration. The same holds while the run's first buckets start (no
        member placed yet, each of theirs slotted): taken oldest first there,
        the run's first four trials were still the grid's first four points
        (one logged stock-ASHA run at 128 trials wasted 394 member-epochs so;
        docs/design.md D4).

        Except where the oldest seated candidate trains ``solo`` (in its
        trial's process, as plain Tune would train it): that one is bound, in
        the searcher's order, as plain Tune runs its configs. Nothing of a solo
        member trains ahead of its trial, so there is no evidence to guard, and
        drawn at random the order of results reaching a stock scheduler was
        another than plain Tune's: on the PyTorch tutorial's 64 trials (stock
        ASHA, every trial solo) 21 trials reached ``max_t`` against plain
        Tune's 17 on the same configs, 140 member-epochs against 131."""
        if trial_id in self.reading:
            member = self.reading[trial_id][0]
            return member if member in candidates else None
        known = [m for m in candidates if seated(m)]
        if not known:
            return None
        if solo is not None and solo(known[0]):
            self.bound[trial_id] = known[0]
            return known[0]
        drawn_from = [m for m in known if placed(m)]
        if not drawn_from and slotted is not None:
            drawn_from = [m for m in known if slotted(m)]
        member = self._rng.choice(drawn_from) if drawn_from else known[0]
        self.bound[trial_id] = member
        return member

    def bind_to(self, trial_id: str, member: str) -> None:
        """``trial_id`` reads ``member`` when it reserves (a scout's own seated member)."""
        self.bound[trial_id] = member

    def is_bound(self, trial_id: str) -> bool:
        return trial_id in self.bound

    def is_reading(self, trial_id: str) -> bool:
        return trial_id in self.reading

    def bound_member(self, trial_id: str, seated: Known) -> str | None:
        """The seated member ``trial_id`` is bound to, if it is still ``seated``;
        a binding to a member that is not (lost with its bucket) is dropped:
        the trial then reads a member of its own."""
        member = self.bound.get(trial_id)
        if member is not None and not seated(member):
            del self.bound[trial_id]
            return None
        return member

    def start(self, trial_id: str, member: str) -> int:
        """``trial_id`` reads ``member`` from now on: the new reservation's token."""
        self._tokens += 1
        self.reading[trial_id] = (member, self._tokens)
        return self._tokens

    def members_read(self) -> set[str]:
        """The members trials read now (a binding alone is not a read: its trial may never start)."""
        return {member for member, _ in self.reading.values()}

    def member_of(self, trial_id: str) -> str:
        """The member ``trial_id`` reads (or is bound to); a name that is no
        trial's is taken for a member's own."""
        reading = self.reading.get(trial_id)
        return reading[0] if reading else self.bound.get(trial_id, trial_id)

    def is_current(self, trial_id: str, token: int | None) -> bool:
        """Whether ``token`` names ``trial_id``'s current reservation (``None``: whichever it is)."""
        if token is None:
            return True
        current = self.reading.get(trial_id)
        return current is not None and current[1] == token

    def leave(self, trial_id: str) -> str | None:
        """``trial_id`` reads nothing and is bound to nothing now: the member
        it read (or was bound to), which leaves; ``None`` when there was none."""
        current = self.reading.pop(trial_id, None)
        bound = self.bound.pop(trial_id, None)
        return current[0] if current is not None else bound
