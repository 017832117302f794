"""Whether Tune starts a process for every trial (Ray-free; the pool keeps one :class:`ActorReuse`).

Tune's ``TuneConfig(reuse_actors=...)`` is off by default, and Ray's own
examples leave it off: every trial is then a new actor process, which imports
Ray Tune (about 1.5 CPU-s here) before it reads its first result. A chorus_tune
trial holds no model, so that start is most of what a trial costs. Ray's
``mnist_pytorch.py`` ported (50 trials on 2 cores, benchmarks/ray_mnist.py)
took 71.8 s as it ships and 16.9 s with ``reuse_actors=True``. Nothing in the
sweep's results shows it, so the pool says it once a run: when the run's
trials so far each came from a process of their own, and there were at least
twice as many of them as ever ran at once (so Tune had trials to reuse
processes for, and did not).
"""
from __future__ import annotations

MIN_TRIALS = 8


class ActorReuse:
    """The trial processes a run's trials reserve from, and when to say they are never reused."""

    def __init__(self, min_trials: int = MIN_TRIALS):
        self.min_trials = min_trials
        self.new_run()

    def new_run(self) -> None:
        """A new Tune run starts in this driver (it may set ``reuse_actors`` otherwise): forget the last."""
        self._trials: set[str] = set()
        self._clients: set[str] = set()
        self._peak = 0
        self._said = False

    @property
    def never_reused(self) -> bool:
        """Whether this run was found to start a process for every trial (:meth:`reserved` said so)."""
        return self._said

    @property
    def trials(self) -> int:
        """How many of the run's trials have reserved so far."""
        return len(self._trials)

    def reserved(self, trial_id: str, client: str | None, in_flight: int) -> bool:
        """Trial ``trial_id`` reserved from the actor ``client`` while ``in_flight``
        trials read members. ``True`` once a run: when every trial so far came
        from an actor of its own, and they number at least ``min_trials`` and
        twice the most that read at once."""
        if client is None or self._said:
            return False
        self._trials.add(trial_id)
        self._clients.add(client)
        self._peak = max(self._peak, in_flight)
        trials = len(self._trials)
        if len(self._clients) < trials or trials < max(self.min_trials, 2 * self._peak):
            return False
        self._said = True
        return True
