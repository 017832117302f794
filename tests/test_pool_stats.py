"""The pool's stats while buckets open (ChorusPool.stats), on a pool object outside Ray."""
import asyncio

from chorus_tune.tune.actors.pool import ChorusPool
from chorus_tune.tune.rules.bucket_history import LIVE_REPORTED


class Describing:
    """A started bucket's handle: ``describe.remote()`` runs ``meanwhile`` (as
    the pool's event loop may while it awaits) and answers."""

    def __init__(self, meanwhile):
        self.describe = self
        self._meanwhile = meanwhile

    async def _answer(self):
        self._meanwhile()
        return {key: 0 for key in LIVE_REPORTED}

    def remote(self):
        return self._answer()


def test_a_bucket_opening_while_the_stats_are_read_does_not_break_them():
    pool = ChorusPool("job")
    pool.history.opened("b1", "MLP", 4, [], None)
    pool.history.started("b1", {"node_id": "n1"})
    pool.handles["b1"] = Describing(lambda: pool.history.opened("b2", "MLP", 4, [], None))
    stats = asyncio.run(pool.stats())
    assert list(stats) == ["b1"] and stats["b1"]["node_id"] == 0


def test_a_moved_members_trial_is_sent_to_its_old_bucket_while_results_wait_there():
    # Regrouping left the member's unread results in its old bucket: its trial
    # reads those first (then hears Moved), whatever bucket holds it now.
    pool = ChorusPool("job")
    pool.handles.update({"old": object(), "new": object()})
    pool.seats.house("m", "new")
    pool._draining["m"] = "old"
    assert asyncio.run(pool.bucket_of("m"))[0] == "old"
    del pool._draining["m"]
    assert asyncio.run(pool.bucket_of("m"))[0] == "new"
