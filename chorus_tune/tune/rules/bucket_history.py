"""What the pool's stats say of every bucket it opened (Ray-free; the pool actor keeps one :class:`BucketHistory`).

A bucket's entry outlives the bucket: ``bucket_stats()`` after a run still
says where each bucket ran, what it trained, and whether it closed, died or
reaped members.
"""
from __future__ import annotations

from typing import Any

# What an open bucket's describe() adds to its entry when the stats are read,
# and what of that the entry keeps for when the bucket has closed.
LIVE_REPORTED = ("node_id", "wasted", "iterations", "route", "max_queue", "decision_points",
                 "member_iterations", "rows_computed")
LIVE_KEPT = ("node_id", "wasted", "iterations", "route", "member_iterations", "rows_computed")


class BucketHistory:
    """One entry per bucket, from its opening on; never dropped."""

    def __init__(self) -> None:
        self._entries: dict[str, dict] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """The buckets opened so far, oldest first: a copy, so a caller that
        awaits each bucket in turn (the pool's stats) may see another open meanwhile."""
        return list(self._entries)

    def opened(self, name: str, model: str, capacity: int, trials: list[str], capacity_fit: dict | None,
               at: float | None = None, solo: bool = False) -> None:
        """Bucket ``name`` opens with ``capacity`` slots. ``trials`` is the
        placement's own list of every member the bucket ever held: shared, not
        copied, so the entry follows members that join later. ``at``: when (a
        monotonic clock), for its start-up time; ``solo``: no bucket actor, but
        a place in the budget whose one member its trial trains (rules/solo.py)."""
        self._entries[name] = {"model": model, "bucket_size": capacity, "capacity": capacity, "trials": trials,
                               "closed": False, "reaped": [], "capacity_fit": capacity_fit, "solo": solo,
                               "_opened_at": at}

    def started(self, name: str, where: dict[str, Any], at: float | None = None) -> None:
        """Bucket ``name`` runs: ``where`` holds its ``node_id``, ``device``,
        ``requested_device`` and ``gpu_ids``. With ``at`` (the clock of
        :meth:`opened`), ``start_s`` is how long it took to start."""
        if name in self._entries:
            entry = self._entries[name]
            entry.update(where)
            if at is not None and entry.get("_opened_at") is not None:
                entry["start_s"] = round(at - entry["_opened_at"], 3)

    def has_started(self, name: str) -> bool:
        """Whether bucket ``name`` has said where it runs (until then nobody in it read anything,
        and it may not answer: it waits for its resources)."""
        return "node_id" in self._entries.get(name, {})

    def node_of(self, name: str) -> str | None:
        return self._entries.get(name, {}).get("node_id")

    def place_of(self, name: str) -> tuple:
        """Where bucket ``name`` trains: its node, device and GPUs (members regroup only within one place)."""
        entry = self._entries.get(name, {})
        return entry.get("node_id"), entry.get("device"), tuple(entry.get("gpu_ids") or ())

    def regrouped(self, source: str, dest: str, members: list[str]) -> None:
        """``members`` moved from bucket ``source`` to bucket ``dest`` (regrouping):
        ``regroups`` counts the moves out of a bucket, ``moved_out``/``moved_in`` the members."""
        if source in self._entries:
            entry = self._entries[source]
            entry["regroups"] = entry.get("regroups", 0) + 1
            entry["moved_out"] = entry.get("moved_out", 0) + len(members)
        if dest in self._entries:
            self._entries[dest]["moved_in"] = self._entries[dest].get("moved_in", 0) + len(members)

    def note(self, name: str | None, reason: str, member: str) -> None:
        """``member`` left bucket ``name`` for ``reason`` (e.g. ``"reaped"``);
        ``None``: it was in no bucket, and nothing is noted."""
        if name in self._entries:
            self._entries[name].setdefault(reason, []).append(member)

    def compacted(self, name: str, capacity: int) -> None:
        entry = self._entries[name]
        entry["capacity"] = capacity
        entry["compactions"] = entry.get("compactions", 0) + 1

    def closed(self, name: str) -> None:
        if name in self._entries:
            self._entries[name]["closed"] = True

    def gone(self, name: str, died: bool, lost: list[str]) -> None:
        """Bucket ``name`` is gone (``died``: not closed by the pool) with the members ``lost``."""
        if name in self._entries:
            self._entries[name].update(closed=True, died=died, lost=lost)

    def report(self, name: str, members: list[str], live: dict[str, Any] | None = None) -> dict:
        """Bucket ``name``'s entry for the stats: a copy, with its current
        ``members`` and, when it answered, what ``live`` (its describe()) says
        now. What of ``live`` stays true after it closes is kept."""
        entry = self._entries[name]
        public = {k: v for k, v in entry.items() if not k.startswith("_")}  # _opened_at: the pool's clock
        out = {**public, "trials": list(entry["trials"]), "reaped": list(entry.get("reaped", [])),
               "members": list(members)}
        if live is not None:
            out.update({k: live[k] for k in LIVE_REPORTED})
            entry.update({k: live[k] for k in LIVE_KEPT})
        return out
