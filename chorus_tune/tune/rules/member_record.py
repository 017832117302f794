"""What a bucket knows of one member: its phase, its queued results, its counters (Ray-free values).

:class:`~chorus_tune.tune.rules.members.MemberBook` keeps one
:class:`MemberRecord` per member and moves it between the :class:`Phase` s.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from chorus_tune.tune.values.plan import Plan


class Phase(str, Enum):
    """Where a member is in its life in one bucket."""

    RESERVED = "reserved"  # placed here, waiting to be built into a slot
    TRAINING = "training"  # in a slot; trains whenever its limit allows
    HELD = "held"  # in a slot, alone at a rung: waits for Tune's decision
    FINISHED = "finished"  # trains no more (budget, max_t, stopped at a rung); results still drain
    LEFT = "left"  # its trial left, or it was reaped: nothing more to read
    FAILED = "failed"  # could not be built (its trial fails with the error)


IN_SLOT = (Phase.TRAINING, Phase.HELD)


@dataclass
class Entry:
    """One computed result waiting for its trial, with the member's state then."""

    iteration: int
    result: dict[str, Any]
    state: Any


@dataclass
class MemberRecord:
    """Everything a bucket knows of one member."""

    member: str
    plan: Plan
    phase: Phase = Phase.RESERVED
    slot: int | None = None
    produced: int = 0  # the member's iteration count after the last one computed
    asked: int = 0  # iterations its trial has asked for (delivered, or waited for)
    taken: int = 0  # iterations delivered to its trial
    queue: deque = field(default_factory=deque)
    state_at_taken: Any = None  # the member's state at ``taken`` (what a checkpoint saves)
    hold_at: int | None = None  # a rung reached alone: no further until asked beyond it
    building: bool = False  # its model is being built into a slot right now
    attached: bool = False  # a trial reads this member's results
    lagging: bool = False  # left out of the last iteration while its trial was behind
    final: int | None = None  # the iteration the bucket made its last (budget, a rung's stop, a stop criterion)
    wasted: int = 0
    error: BaseException | None = None
    # A cohort token carried from another bucket (regrouping.py): cohorts form
    # only among members of one token. None: never moved (D11's rule as it is).
    cohort: str | None = None
    stop_counted: bool = False  # its trial's leave was counted as Tune's stop (MemberBook.count_stop)

    @property
    def in_slot(self) -> bool:
        return self.phase in IN_SLOT

    @property
    def drained(self) -> bool:
        """Nothing more will ever be read from this member: it left, or failed.
        A finished member whose trial has read every result is not drained
        until its trial leaves: Tune still saves that trial's checkpoint at the
        end, and the save reads the member's state from its bucket."""
        return self.phase in (Phase.LEFT, Phase.FAILED)
