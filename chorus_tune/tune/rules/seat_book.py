"""Seated members, the ones that cannot be built, and the bucket each member's records live in
(Ray-free; the pool actor keeps one :class:`SeatBook`).

ChorusSearch seats members before Tune creates their trials (docs/design.md
D2, D10). A seated member is built from its :class:`~.options.Join`; one whose
model cannot be built stays seated as *failed*, so that the trial bound to it
fails with the factory's error. A member's *home* is the bucket that holds its
records: its slot, or, once it finished, its results still to drain.
"""
from __future__ import annotations

from collections.abc import Collection

from chorus_tune.tune.values.options import Join


class SeatBook:
    """Per member: what it is seated with, why it cannot be built, and its home bucket."""

    def __init__(self) -> None:
        self.seats: dict[str, Join] = {}  # seated members: what they are built from
        self.failed: dict[str, BaseException] = {}  # seated members whose model cannot be built
        self.homes: dict[str, str] = {}  # member -> the bucket holding its records (slot, or results to drain)

    # ----- seating ---------------------------------------------------------------------------------
    def seat(self, member: str, join: Join) -> None:
        self.seats[member] = join

    def fail(self, member: str, exc: BaseException) -> None:
        """``member``'s model cannot be built: its trial fails with ``exc``."""
        self.failed[member] = exc

    def unseat(self, member: str) -> None:
        """``member`` is seated afresh (a scout's member, seated now with its cohort)."""
        self.seats.pop(member, None)

    def is_kept(self, member: str) -> bool:
        """Whether seating ``member`` again keeps it as it is: it is seated, has
        a home, or cannot be built. (ChorusSearch restored in this job seats
        again: the member's state is what a fresh seat would compute, only
        further along, and its results wait from the first one its trial has
        not read. Restarting it would pull it from under a trial that already
        reads it or waits for its slot.)"""
        return member in self.seats or member in self.homes or member in self.failed

    def status(self, member: str) -> str:
        """What :meth:`ChorusPool.seat` says of ``member``: ``"failed"`` (it cannot
        be built), ``"seated"`` (it has a bucket) or ``"queued"`` (it waits for a slot)."""
        if member in self.failed:
            return "failed"
        return "seated" if member in self.homes else "queued"

    def is_seated(self, member: str) -> bool:
        """Whether a trial bound to ``member`` reads it: a member whose model
        cannot be built stays seated (its trial fails with the factory's error)."""
        return member in self.seats or member in self.failed

    def unread(self, read: Collection[str], spare: str) -> list[str]:
        """Seated members (those that cannot be built too) that no trial reads,
        given the members trials ``read`` now, oldest seat first, sparing those
        whose names start with ``spare`` (the new run's own search's). When a
        new run starts in this job, these are what earlier runs seated and
        never handed to a trial that ran: a run that ended early (a stopper's
        ``stop_all``, ``time_budget_s``, an error) leaves them seated, and
        nothing else ever reads them."""
        read = set(read)
        return [m for m in dict.fromkeys([*self.seats, *self.failed])
                if m not in read and not m.startswith(spare)]

    def join_of(self, member: str) -> Join | None:
        return self.seats.get(member)

    def failure(self, member: str) -> BaseException | None:
        return self.failed.get(member)

    # ----- homes -----------------------------------------------------------------------------------
    def house(self, member: str, bucket: str) -> None:
        """``bucket`` expects ``member`` now: its home (only then, or a trial
        that asks the bucket would find no such member there)."""
        self.homes[member] = bucket

    def unhouse(self, member: str) -> None:
        """``member`` has no home until it is housed again (it moves to another place)."""
        self.homes.pop(member, None)

    def home(self, member: str) -> str | None:
        return self.homes.get(member)

    def is_housed(self, member: str) -> bool:
        return member in self.homes

    # ----- members out -----------------------------------------------------------------------------
    def leave(self, member: str) -> str | None:
        """``member`` is no longer read: its seat, failure and home go. Its home, if it had one."""
        self.seats.pop(member, None)
        self.failed.pop(member, None)
        return self.homes.pop(member, None)

    def out(self, member: str, reason: str) -> None:
        """``member``'s bucket freed its slot for ``reason``: a ``"finished"``
        member keeps its home (its results still drain from there); any other
        loses it, and a ``"reaped"`` one its seat too (seated again, it starts afresh)."""
        if reason != "finished":
            self.homes.pop(member, None)
        if reason == "reaped":
            self.seats.pop(member, None)

    def evicted(self, member: str, bucket: str) -> None:
        """``bucket`` gave ``member``'s slot up: it has no home, unless it has moved elsewhere."""
        if self.homes.get(member) == bucket:
            self.homes.pop(member)

    def bucket_lost(self, bucket: str) -> list[str]:
        """``bucket`` is gone: the members it held, which lose their home and
        their seat (a trial bound to one then reads a member of its own)."""
        lost = [m for m, home in self.homes.items() if home == bucket]
        for member in lost:
            self.homes.pop(member, None)
            self.seats.pop(member, None)
        return lost
