"""Members on their way out of their buckets (Ray-free; the pool keeps one :class:`Leaving`).

A member leaves in two parts: the pool forgets it at once, then tells its
bucket, which frees the slot only between iterations, so that part can take
as long as the running iteration. A trial's own member is named by its trial
id, and a trial that reserves again (a PBT exploit, a restart, a resume)
reuses that name. Placed while its last leave still waited in the bucket, the
new member was taken there for the old one: its join (the restored state, the
new config) was ignored, the trial read the old member's queued results, and
then the leave landed and took the new member with it ("member ... is not in
bucket"). Seen in ``examples/pbt.py`` with ``reuse_actors=True``, 3 runs in 21,
where ``reset_config`` leaves without waiting (``ChorusTrainable._leave``) and
the same actor reserves again at once. The pool waits for :meth:`Leaving.finished`
before it places a name again.
"""
from __future__ import annotations

import asyncio


class Leaving:
    """The members whose leave is under way, each with how many leaves of it are."""

    def __init__(self) -> None:
        self._under_way: dict[str, tuple[int, asyncio.Event]] = {}

    def start(self, member: str) -> None:
        """A leave of ``member`` begins (the pool forgot it; its bucket is not told yet)."""
        count, done = self._under_way.get(member, (0, None))
        self._under_way[member] = (count + 1, done or asyncio.Event())

    def end(self, member: str) -> None:
        """A leave of ``member`` that :meth:`start` began is over (its bucket knows, or is gone)."""
        count, done = self._under_way[member]
        if count > 1:
            self._under_way[member] = (count - 1, done)
            return
        del self._under_way[member]
        done.set()

    def is_leaving(self, member: str) -> bool:
        return member in self._under_way

    async def finished(self, member: str, timeout_s: float) -> None:
        """Returns once no leave of ``member`` is under way (at once when none
        is). Raises ``TimeoutError`` after ``timeout_s``: a bucket's leave waits
        for its running iteration, and one that never ends must not hold the
        member's trial for good."""
        try:
            await asyncio.wait_for(self._none_left(member), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"member {member} was still leaving its bucket after {timeout_s:g} s "
                               "(result_timeout_s): the bucket's running iteration has not ended") from None

    async def _none_left(self, member: str) -> None:
        while member in self._under_way:
            await self._under_way[member][1].wait()
