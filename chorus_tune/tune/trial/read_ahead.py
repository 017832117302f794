"""Results a trial fetched from its bucket ahead of Tune (Ray-free; docs/design.md D3, D4).

A bucket computes a member's results ahead of its trial, and they wait in the
member's queue there. One call to the bucket costs the trial about 20 ms on a
busy machine (its event loop shares the process with the fused step), far
more than Tune's own per-result work, so the trial fetches every result
already queued in one call and its ``step`` returns them one at a time from
here. The bucket keeps each queued result's member state: a fetched result
carries none, and a checkpoint asks the bucket for the state of the one
iteration Tune read last (:attr:`ReadAhead.read`).

What the bucket must learn from the trial is where Tune is, not where the
fetch reached: the trial tells it :attr:`read` at its next fetch, at a save
and when it leaves. So a trial that Tune stops with results still held here
counts those as wasted, and the bucket learns the decision point at the
iteration Tune stopped it, as if each result had been fetched alone.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from chorus_tune.tune.values import result_keys as rk


class ReadAhead:
    """The fetched results a trial's ``step`` has yet to return, and the last one it returned.

    ``read`` is the member iteration of the last result :meth:`take` handed
    to Tune (``None`` before the first, and after :meth:`drop`).
    """

    def __init__(self) -> None:
        self._results: deque[dict[str, Any]] = deque()
        self.read: int | None = None

    def __len__(self) -> int:
        return len(self._results)

    @property
    def empty(self) -> bool:
        """Nothing fetched is left: the next ``step`` asks its bucket."""
        return not self._results

    def fill(self, results: list[dict[str, Any]]) -> None:
        """The results one fetch brought, oldest first. A fetch comes only once
        the last one's results are all taken (the bucket counts what a trial
        read from its reports, in order)."""
        if self._results:
            raise RuntimeError("a trial fetched results while it still held results it had not returned")
        for result in results:
            self._results.append(result)
            if result.get("done"):
                # A last result (a budget, a stop criterion, a finished member):
                # Tune stops the trial at it, so nothing after it is read.
                break

    def take(self) -> dict[str, Any] | None:
        """The next fetched result, for Tune now; ``None`` when none is left."""
        if not self._results:
            return None
        result = self._results.popleft()
        iteration = result.get(rk.ITERATION)
        if isinstance(iteration, int) and not result.get(rk.RETIRED):
            self.read = iteration
        return result

    def drop(self) -> int | None:
        """Forget everything fetched (the trial leaves its member: Tune stopped
        it, ``reset_config``, ``load_checkpoint``, a lost bucket). Returns the
        iteration Tune read last, for the leave to tell the bucket."""
        read, self.read = self.read, None
        self._results.clear()
        return read
