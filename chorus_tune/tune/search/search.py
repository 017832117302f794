"""ChorusSearch: draws trials ahead of Tune and seats them in buckets at once (docs/design.md D10).

Grouping by structure and refilling freed slots live in the pool
(:mod:`chorus_tune.tune.rules.placement`, no Ray); this module is the Tune plumbing:
drawing ahead, seating, binding trials to members, id maps, save/restore. Learning
the task from a first trial, without ``task=``, is its part in :mod:`.scouting`.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import ray
from ray.tune.search import ConcurrencyLimiter, Searcher

from chorus_tune.config_keys import users_config
from chorus_tune.tune.rules.resources import bucket_budget, bucket_resources
from chorus_tune.tune.values import run_plan

from .persistence import read_state, write_state
from .sampler import SpaceSampler, grid_size
from .scouting import ScoutLearning

logger = logging.getLogger(__name__)


# Trials seen continued past an iteration that clear it for speculation
# (docs/design.md D4): stock ASHA continues all of a rung's first k arrivals
# with probability 1/k!, so 4 leave 1 run in 24 to speculate past its first
# rung. The default concurrency is at least this, so that under FIFO the
# trials in flight clear every iteration without waiting for trials to end.
CLEAR_AFTER = 4


def _default_concurrency() -> int:
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else (os.cpu_count() or 1)
    return max(CLEAR_AFTER, cpus)


# How far ahead ChorusSearch's own sampler draws, in look-aheads of a search
# with a model-based searcher (at most): it learns nothing from results, so
# drawing ahead costs no adaptivity, and a run's members seated at once keep its
# buckets full. Measured (128 trials, ChorusASHA, buckets of 16, 2 at a time, 2
# cores): seated 48 ahead, the buckets ran 5.3-5.8 live members per fused
# iteration, as pruned members waited unread for trials that Tune had not yet
# started, holding the look-ahead; seated all at once, 7.0-8.6. The bound keeps
# a run of thousands of samples from seating them all in the pool at once.
SAMPLER_LOOKAHEAD_FACTOR = 8


def default_lookahead(fill: int, budget: Optional[int], learns_from_results: bool) -> int:
    """Seated members not yet bound to a trial, by default: ``fill`` (enough to
    fill every bucket, and one bucket more for refills) where the searcher
    learns from results, so that it is asked only that far ahead of them; else
    the run's whole ``budget`` (``num_samples``), up to
    :data:`SAMPLER_LOOKAHEAD_FACTOR` times ``fill``."""
    if learns_from_results or budget is None:
        return fill
    return max(fill, min(budget, SAMPLER_LOOKAHEAD_FACTOR * fill))


def seat_step(cluster: Dict, options: Any, bucket_size: int, max_buckets: Optional[int]) -> int:
    """Members seated per call at most: every bucket the cluster holds full, and one more for refills."""
    per_bucket = bucket_resources(options.resources_per_bucket, cluster)
    return bucket_size * ((max_buckets or bucket_budget(cluster, per_bucket)) + 1)


def clear_after(in_flight: int, budget: Optional[int]) -> int:
    """Continues that clear an iteration for speculation (docs/design.md D4): no
    more than the trials in flight (FIFO would wait for trials to end), nor
    than the run has trials."""
    return max(1, min(CLEAR_AFTER, in_flight, budget or CLEAR_AFTER))


def _trainable_class(task: Any) -> Any:
    """The ChorusTrainable class whose members ChorusSearch seats, or None."""
    if task is None:
        return None
    if isinstance(task, type) and getattr(task, "_task_blob", None) is not None:
        return task
    if isinstance(task, type) and getattr(task, "task", None) is not None:
        return task
    raise TypeError(
        "task must be the ChorusTrainable class you give tune.Tuner (ChorusTrainable.for_task(...) or a "
        f"subclass with a `task`); got {task!r}")


class ChorusSearch(ScoutLearning, ConcurrencyLimiter):
    """Seats trials in buckets before Tune asks for them, then hands them to Tune.

    Suggestions (from ``searcher``, or sampled from ``param_space`` as Tune's
    default does when ``searcher`` is None) are drawn ``lookahead`` ahead of
    Tune and **seated at once**: the pool puts each in a bucket of its
    structure (docs/design.md D9, D10), where it trains — ahead of any trial —
    as far as its plan allows (docs/design.md D4). When Tune asks for a trial,
    it is bound to an already seated member (one with a bucket first), so
    trial actors only read results: a sweep needs about as many trial
    processes as plain Tune would run (``max_concurrent_trials``, default one
    per CPU and at least 4), whatever the bucket size. Results and completions reach the
    inner searcher per trial, under the ids it suggested.

    Args:
        searcher: any Tune ``Searcher`` (e.g. ``OptunaSearch``); None samples
            ``param_space`` itself (grid axes and random distributions).
        task: the ChorusTrainable class you give ``tune.Tuner`` (its task and
            bucket options are what members are seated with). Optional: without
            it, the search learns them from the run's first trial (a *scout*:
            Tune starts it alone, its member waits for the rest of its cohort,
            and everything after behaves exactly as with ``task=``). A run whose
            trainable is not a ChorusTrainable gets a warning and no seating.
        max_concurrent_trials: trials Tune runs at once (each is a process
            that reads results). Default: the cluster's CPUs, at least
            ``CLEAR_AFTER`` (4): under FIFO the trials in flight clear each
            iteration for the members to train past (docs/design.md D4).
        max_iterations: an iteration budget for every trial (else the
            trainable's ``max_iterations``), saying nothing else ends a trial
            early. Not needed for speed: with a run's
            ``stop={"training_iteration": n}`` members train to ``n`` without
            waiting for their trials, except past the iterations where Tune
            has been seen stopping trials early (docs/design.md D4).
        lookahead: seated members not yet bound to a trial. Default, with a
            ``searcher``: enough to fill every bucket, plus one bucket more for
            refills; lower it to keep a model-based searcher more adaptive (it
            is asked that many suggestions ahead of the results). Default
            without one (sampling ``param_space``, which learns nothing from
            results): the whole run, up to 8 times that (:func:`default_lookahead`),
            so pruned members that wait for their trials to read them do not
            hold back the members that would fill their slots.
        max_buckets / bucket_size: default to the trainable's.
        random_state: seed for sampling ``param_space`` (no inner searcher).

    Trial count, and why ``reuse_actors=True``: docs/guide/pruning.md.
    """

    def __init__(
        self,
        searcher: Optional[Searcher] = None,
        task: Any = None,
        max_concurrent_trials: Optional[int] = None,
        max_iterations: Optional[int] = None,
        lookahead: Optional[int] = None,
        bucket_size: Optional[int] = None,
        max_buckets: Optional[int] = None,
        random_state: Optional[int] = None,
    ):
        trainable = _trainable_class(task)
        options = trainable.bucket_options() if trainable is not None else None
        self._options = options
        # What members are seated with: the trainable's task (by id; its bytes
        # only when the pool asks) and bucket options. Learnt from the run's
        # first trial when no task is given (see _learn_from_scout).
        self._task_id: Optional[str] = trainable._task_id if trainable is not None else None
        self._task_blob: Optional[bytes] = trainable._task_blob if trainable is not None else None
        # The thread that says how the run's space splits into structures (set_search_properties).
        self.split_report: Optional[threading.Thread] = None
        self._learning = trainable is None  # no task given: the first trial is a scout
        self._learnt = False
        self._scout: Optional[str] = None  # the scout's Tune trial id, while its task is not known
        self._bucket_size_given = bucket_size
        self.bucket_size = bucket_size or (options.expected_size if options else 16)
        self.max_buckets = max_buckets if max_buckets is not None else (options.max_buckets if options else None)
        if max_iterations is not None and max_iterations < 1:
            raise ValueError(f"max_iterations must be positive; got {max_iterations}")
        if max_concurrent_trials is not None and max_concurrent_trials < 1:
            raise ValueError(f"max_concurrent_trials must be positive; got {max_concurrent_trials}")
        inner = searcher if searcher is not None else SpaceSampler(random_state)
        super().__init__(inner, max_concurrent=max_concurrent_trials or _default_concurrency())
        self._own_sampler = searcher is None
        self._concurrency_given = max_concurrent_trials is not None
        self.max_iterations = max_iterations
        self._lookahead_given = lookahead
        self.lookahead = max(1, lookahead) if lookahead is not None else 2 * self.bucket_size
        self._seat_step = self.lookahead  # seated per call at most (_top_up)
        self._prefix = f"chorus_{uuid.uuid4().hex[:6]}_"  # unique among searches sharing a pool
        # Member seeds follow the draw order, not the random prefix: with a
        # random_state the same sweep gets the same seeds, run after run.
        self._seed_base = None if random_state is None else f"chorus-seed-{random_state}-"
        self._pulled = 0                 # suggestions taken from the inner searcher
        self._budget: Optional[int] = None  # num_samples: never pull more
        self._exhausted = False          # the inner searcher said FINISHED
        self._stop_at: Optional[int] = None
        self._stop_criteria: Tuple[Tuple[str, float], ...] = ()
        self._rank: Optional[Tuple[str, float]] = None  # the run's (metric, sign): the read order's
        self._unbound: List[Tuple[str, Dict]] = []  # seated (or held) suggestions, oldest first
        self._solo: set = set()  # seated suggestions whose trial trains its member itself (rules/solo.py)
        self._inner_id: Dict[str, str] = {}    # Tune trial id -> inner id (= member id)
        self._configs: Dict[str, Dict] = {}    # inner id -> config, while its trial runs
        self._seated_here = False  # members of _unbound/_inner_id are seated in this driver's pool

    # -- Tune's side ---------------------------------------------------------
    def set_search_properties(
        self, metric: Optional[str], mode: Optional[str], config: Dict, **spec
    ) -> bool:
        num_samples = spec.get("num_samples")
        if self._own_sampler and config:
            # Before anything else (the pool's new_run): a refused run changes nothing.
            run_plan.check_grid_samples(grid_size(config), num_samples if isinstance(num_samples, int) else None)
        if isinstance(num_samples, int) and num_samples > 0:
            self._budget = num_samples
        self._stop_at, self._stop_criteria = run_plan.stop_terms(spec.get("stop"))
        self._rank = run_plan.rank_of(metric, mode) or run_plan.rank_of(
            getattr(self.searcher, "metric", None), getattr(self.searcher, "mode", None))
        run_plan.clear()  # ChorusASHA, if it runs, announces its rungs next
        if ray.is_initialized():
            self._size_for_cluster()
            from chorus_tune.tune import client

            # Starts now (a second or two) while Tune sets up the run; not waited
            # for. It may reach the pool after the first seats (an async actor
            # does not keep the order of its calls): it spares this search's members.
            client.new_run(self._prefix)
            if self._task_blob is not None:
                client.learn_task(self._task_id, self._task_blob)
            run_plan.search_seats_cohorts()
        if config and self._task_blob is not None:
            from .space_split import say_how_it_splits

            # Beside Tune's way to its first trial, not on it: where widths differ,
            # reading the split loads the task's data to price their padding, and it is
            # a message, not a decision. Measured on synth-mixed's 16k rows (2 cores):
            # this call returned after 2.2-3.2 s before, 0.09 s now.
            self.split_report = threading.Thread(
                target=say_how_it_splits, args=(self._task_blob, config, num_samples, self.bucket_size,
                                                self._options, self._task_id if self.seating else None),
                name="chorus-space-split", daemon=True)
            self.split_report.start()
        return super().set_search_properties(metric, mode, config, **spec)

    def suggest(self, trial_id: str) -> Optional[Union[Dict, str]]:
        suggestion = self._suggest(trial_id)
        if isinstance(suggestion, dict):
            # Tune creates this trial next: its token holds its share of the
            # buckets' cores (chorus_tune.tune.rules.resources).
            run_plan.hand_trial_concurrency(self.max_concurrent, solo=self._inner_id.get(trial_id) in self._solo)
        return suggestion

    def _suggest(self, trial_id: str) -> Optional[Union[Dict, str]]:
        if len(self.live_trials) >= self.max_concurrent:
            return None
        if self._learning and ray.is_initialized():
            if self._scout is None:
                return self._send_scout(trial_id)
            if not self._learn_from_scout() and self._learning:
                return None  # Tune asks again; the scout's first step teaches the task
        if not self._seated_here:
            self._reseat()
        self._top_up()
        if not self._unbound:
            if self._exhausted or self._budget_spent():
                return Searcher.FINISHED
            return None
        item_id = self._bind(trial_id)
        config = self._configs[item_id]
        self._inner_id[trial_id] = item_id
        self.live_trials.add(trial_id)
        self.num_unfinished_live_trials += 1
        self._top_up()
        return copy.deepcopy(config)

    def on_trial_result(self, trial_id: str, result: Dict) -> None:
        self._tell_inner("on_trial_result", trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: Optional[Dict] = None, error: bool = False
    ) -> None:
        if self._learning and trial_id == self._scout and not self._learn_from_scout():
            # The scout ended without reaching the pool: not a ChorusTrainable
            # (or it failed before its first step).
            self._stop_learning(f"its first trial {trial_id} ended without reaching a bucket")
        inner = self._inner_id.pop(trial_id, None)
        if inner is None:
            return
        self._configs.pop(inner, None)
        self.live_trials.discard(trial_id)
        self.num_unfinished_live_trials -= 1
        self.searcher.on_trial_complete(inner, result=result, error=error)

    def on_pause(self, trial_id: str) -> None:
        self._tell_inner("on_pause", trial_id)

    def on_unpause(self, trial_id: str) -> None:
        self._tell_inner("on_unpause", trial_id)

    def _tell_inner(self, method: str, trial_id: str, *args: Any) -> None:
        """The inner searcher hears of a trial under the id it suggested (if it suggested it)."""
        inner = self._inner_id.get(trial_id)
        if inner is not None:
            getattr(self.searcher, method)(inner, *args)

    # -- views ---------------------------------------------------------------
    @property
    def unbound(self) -> List[str]:
        """Ids of the suggestions drawn (and seated) that no trial reads yet, oldest first."""
        return [item for item, _ in self._unbound]

    @property
    def seating(self) -> bool:
        """Whether this search seats members (it knows the trainable, and Ray runs)."""
        return self._task_id is not None and ray.is_initialized()

    # -- drawing and seating -------------------------------------------------
    def _size_for_cluster(self) -> None:
        cluster = ray.cluster_resources()
        if not self._concurrency_given:
            self.max_concurrent = _default_concurrency()
        if self._lookahead_given is None and self._options is not None:
            self._seat_step = seat_step(cluster, self._options, self.bucket_size, self.max_buckets)
            self.lookahead = default_lookahead(self._seat_step, self._budget,
                                               learns_from_results=not self._own_sampler)

    def _budget_spent(self) -> bool:
        return self._budget is not None and self._pulled >= self._budget

    def _top_up(self) -> None:
        """Keep ``lookahead`` suggestions drawn and seated while the budget lasts,
        at most a bucket more than the buckets hold per call: the first seat,
        which the run's first result waits for, stays as small as it was before
        the sampler's look-ahead grew to the whole run; Tune's next few calls
        seat the rest."""
        # In one go per call: seated together, they train together.
        self._seat(self._draw())

    def _draw(self) -> List[Tuple[str, Dict]]:
        """Up to ``_seat_step`` suggestions more, while fewer than ``lookahead`` are unbound."""
        drawn = []
        while (not self._exhausted and not self._budget_spent()
               and len(self._unbound) < self.lookahead and len(drawn) < self._seat_step):
            pulled = self._pull()
            if pulled is None:
                break
            drawn.append(pulled)
        return drawn

    def _pull(self) -> Optional[Tuple[str, Dict]]:
        item_id = f"{self._prefix}{self._pulled:05d}"
        config = self.searcher.suggest(item_id)
        if config == Searcher.FINISHED:
            self._exhausted = True
            return None
        if config is None:
            return None
        self._pulled += 1
        self._unbound.append((item_id, config))
        self._configs[item_id] = config
        return item_id, config

    def _plan(self):
        return self._options.plan(run_plan.announced(), budget=self.max_iterations, stop_at=self._stop_at,
                                  stop_criteria=self._stop_criteria,
                                  clear_after=clear_after(self.max_concurrent, self._budget), rank=self._rank)

    def _seat(self, drawn: List[Tuple[str, Dict]]) -> None:
        if not self.seating or not drawn:
            return
        from chorus_tune.tune import client

        seats = [self._seat_of(item_id, config) for item_id, config in drawn]
        # A pool that died is replaced (docs/design.md "Faults"), not the run's end.
        statuses = client.seat(seats, self._task_id, self._task_blob, self._options, self._plan())
        if isinstance(statuses, dict):
            self._solo.update(item for item, status in statuses.items() if status == "solo")
        if self._options.auto and self._bucket_size_given is None:
            self._learn_bucket_size(seats[0][1])

    def _learn_bucket_size(self, config: Dict) -> None:
        from chorus_tune.tune import client

        # An "auto" size is measured when the first members are seated; look
        # far enough ahead to fill buckets of the size measured, not guessed.
        try:
            size = client.bucket_size_for(self._task_id, self._options, config)
        except Exception:  # noqa: BLE001 - the seated members carry the error to their trials
            return
        if size != self.bucket_size:
            self.bucket_size = size
            if self._lookahead_given is None:
                self._size_for_cluster()

    def _seat_of(self, item_id: str, config: Dict) -> Tuple[str, Dict, int]:
        """What the pool seats for a drawn suggestion: ``(member, the user's config, seed)``.
        The seed is fixed now, before any trial exists: chorus/seed reports it,
        and reference.train(task, config, seed) replays the member."""
        from chorus_tune.tune.values.options import member_seed

        clean = users_config(config)
        return item_id, clean, member_seed(clean, self._seed_name(item_id))

    def _seed_name(self, item_id: str) -> str:
        """What a member's default seed derives from (its config's ``seed`` wins)."""
        if self._seed_base is None:
            return item_id
        return self._seed_base + item_id[len(self._prefix):]

    def _bind(self, trial_id: str) -> str:
        candidates = self.unbound
        chosen = None
        if self.seating:
            from chorus_tune.tune import client

            chosen = client.bind(trial_id, candidates)
        if chosen is None:
            chosen = candidates[0]
        if chosen in self._solo and self.seating and not client.trains_solo(chosen):
            # Sent back to a bucket since it was seated (the pool's _back_to_buckets):
            # its trial holds a bucket trial's share of the cores, not a solo one's.
            self._solo.discard(chosen)
        self._unbound = [(i, c) for i, c in self._unbound if i != chosen]
        return chosen

    def _reseat(self, draw: bool = False) -> None:
        """Seat what this search holds in this driver's pool: after a restore,
        the pool is new (its buckets died with the old driver); after a scout
        taught the task, nothing is seated yet. ``draw``: top up in the same go."""
        self._seated_here = True
        if not self.seating:
            return
        from chorus_tune.tune import client

        # Trials Tune created but that have not finished are re-seated with
        # their seeds (a checkpoint one resumes from replaces the seated state).
        running = [(item_id, self._configs[item_id]) for item_id in self._inner_id.values()]
        self._seat(running + list(self._unbound) + (self._draw() if draw else []))
        client.bind_again(dict(self._inner_id))

    # -- save / restore ------------------------------------------------------
    _NOT_SAVED = ("searcher", "_seated_here", "_task_blob", "split_report")

    def __getstate__(self) -> Dict:
        # Tune pickles its search algorithm with the run's state; a thread cannot be.
        return {**self.__dict__, "split_report": None}

    def get_state(self) -> Dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_SAVED}
        return copy.deepcopy(state)

    def set_state(self, state: Dict) -> None:
        self.__dict__.update(state)
        self._seated_here = False
        if self._learnt:
            # A new pool has never seen the task, and this search never had its
            # bytes: learn it again, from the first trial of the restored run.
            self._learning, self._scout, self._task_id = True, None, None

    def save(self, checkpoint_path: str) -> None:
        """Buffer, id maps and the inner searcher's own state, in one file."""
        write_state(checkpoint_path, self.get_state(), self.searcher)

    def restore(self, checkpoint_path: str) -> None:
        self.set_state(read_state(checkpoint_path, self.searcher))
