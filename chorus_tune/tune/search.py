"""ChorusSearch: a search wrapper that fills buckets with compatible trials (DESIGN.md D10).

The release/refill policy lives in :mod:`chorus_tune.tune.grouping` (no Ray);
this module is the Tune plumbing: id maps, the inner searcher, save/restore.
"""
from __future__ import annotations

import copy
import logging
import os
import pickle
import tempfile
import uuid
from typing import Any, Callable, Dict, Hashable, List, Optional, Union

import numpy as np
import ray
import ray.cloudpickle as cloudpickle
from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.variant_generator import generate_variants

from chorus_tune.tune.grouping import SlotBook

logger = logging.getLogger(__name__)

# Tune keeps `max_concurrent` trials pending; with no bucket limit, let it ask
# for as many as the search will release (BasicVariantGenerator allows 200+).
_UNLIMITED = 10**6


class SpaceSampler(Searcher):
    """Samples ``param_space`` as Tune's default generator does (grid + random).

    Each pass walks every grid point in Tune's order, drawing the random axes
    afresh for each point; passes repeat until the search stops asking. Used
    by ``ChorusSearch`` when it is given no searcher.
    """

    CKPT_FILE_TMPL = "chorus-sampler-state-{}.pkl"

    def __init__(self, random_state: Optional[int] = None):
        super().__init__()
        self._space: Optional[Dict] = None
        self._rng = np.random.default_rng(random_state)
        self._pass: List[Dict] = []
        self.grid_size = 1

    def set_search_properties(
        self, metric: Optional[str], mode: Optional[str], config: Dict, **spec
    ) -> bool:
        self._space = copy.deepcopy(config) if config else None
        self._pass = []
        if self._space:
            self.grid_size = sum(1 for _ in generate_variants(
                {"config": self._space}, random_state=np.random.default_rng(0)))
        return True

    def suggest(self, trial_id: str) -> Optional[Dict]:
        if not self._space:
            return {}
        if not self._pass:
            # Materialised per pass (like Tune's own generator below 1e6
            # variants) so the sampler's state pickles for Tuner.restore.
            self._pass = [spec["config"] for _, spec in generate_variants(
                {"config": self._space}, random_state=self._rng)]
        return self._pass.pop(0)

    def on_trial_complete(
        self, trial_id: str, result: Optional[Dict] = None, error: bool = False
    ) -> None:
        pass  # random and grid sampling learn nothing from results

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            cloudpickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(cloudpickle.load(f))


def _resolve_task(task: Any) -> Any:
    """The Task behind ``task``: a Task, a ChorusTrainable class, or None."""
    if task is None or hasattr(task, "structural_key"):
        return task
    inner = getattr(task, "task", None)  # a subclass with a `task` attribute
    if inner is None and getattr(task, "_task_blob", None) is not None:
        inner = cloudpickle.loads(task._task_blob)  # ChorusTrainable.for_task(...)
    if inner is None or not hasattr(inner, "structural_key"):
        raise TypeError(f"task must be a chorus_tune.Task or a ChorusTrainable class; got {task!r}")
    return inner


class ChorusSearch(ConcurrencyLimiter):
    """Hands Tune trials in groups that share a bucket, and refills freed slots.

    Suggestions (from ``searcher``, or sampled from ``param_space`` as Tune's
    default does when ``searcher`` is None) are held in a buffer grouped by
    structural key (DESIGN.md D9). Tune receives them so that a bucket of one
    key fills to ``bucket_size`` before another opens, and a slot freed by a
    pruned, finished or failed trial goes to the oldest waiting suggestion of
    the same key. Results and completions reach the inner searcher per trial,
    under the ids it suggested.

    Args:
        searcher: any Tune ``Searcher`` (e.g. ``OptunaSearch``); None samples
            ``param_space`` itself (grid axes and random distributions).
        bucket_size: slots per bucket. None: the trainable's own (when
            ``task`` is a ChorusTrainable class), else 16.
        max_buckets: at most this many buckets open at once. None: the
            trainable's ``max_buckets`` when it has one, else no limit.
            The concurrency Tune sees is ``bucket_size * max_buckets``. Set it
            with a model-based searcher, so it is asked only as fast as slots
            free up. (Use this, not ``TuneConfig(max_concurrent_trials=...)``:
            Tune refuses both.)
        lookahead: how many suggestions wait in the buffer (default
            ``bucket_size``), kept topped up while ``num_samples`` lasts: the
            pool then knows trials of a key are coming and refills a pruned
            bucket instead of compacting it. Raise it when the space mixes
            structures (more choice to fill a bucket with); lower it to keep
            a model-based searcher more adaptive (it is asked that many
            suggestions ahead of the results).
        task: what decides the structural key: a ``chorus_tune.Task``, or a
            ChorusTrainable class (``ChorusTrainable.for_task(...)`` or a
            subclass with ``task``). Needed because a Searcher never sees the
            trainable: pass the same class you give ``tune.Tuner``. Without it (and without
            ``key``) every config counts as one structure.
        key: instead of ``task``, a function ``config -> hashable key``.
        random_state: seed for sampling ``param_space`` (no inner searcher).

    Trial count: with any Searcher, Tune creates ``num_samples`` trials in
    all (not ``num_samples`` times the grid, as its default generator does).
    The sampler walks the whole grid, then walks it again with new random
    draws: set ``num_samples`` to the grid size times the repeats you want.
    """

    def __init__(
        self,
        searcher: Optional[Searcher] = None,
        bucket_size: Optional[int] = None,
        max_buckets: Optional[int] = None,
        lookahead: Optional[int] = None,
        task: Any = None,
        key: Optional[Callable[[Dict], Hashable]] = None,
        random_state: Optional[int] = None,
    ):
        # A trainable class knows its own bucket size and bucket limit.
        if bucket_size is None:
            bucket_size = getattr(task, "bucket_size", None) or 16
        if max_buckets is None and isinstance(getattr(task, "max_buckets", None), int):
            max_buckets = task.max_buckets
        self._book = SlotBook(bucket_size, max_buckets)  # validates the sizes
        inner = searcher if searcher is not None else SpaceSampler(random_state)
        max_concurrent = bucket_size * max_buckets if max_buckets else _UNLIMITED
        super().__init__(inner, max_concurrent=max_concurrent)
        self._own_sampler = searcher is None
        self._task = _resolve_task(task) if key is None else None
        self._key_fn = key if key is not None else getattr(self._task, "structural_key", None)
        self.lookahead = max(1, lookahead if lookahead is not None else bucket_size)
        self._prefix = f"chorus_{uuid.uuid4().hex[:6]}_"
        self._pulled = 0                 # suggestions taken from the inner searcher
        self._budget: Optional[int] = None  # num_samples: never pull more
        self._exhausted = False          # the inner searcher said FINISHED
        self._inner_id: Dict[str, str] = {}    # Tune trial id -> inner id
        self._key_of: Dict[str, Hashable] = {}  # Tune trial id -> structural key
        self._unstarted: Dict[str, Hashable] = {}  # released, no result yet
        self._pool_ready = False  # this process made sure the pool exists

    # -- Tune's side ---------------------------------------------------------
    def set_search_properties(
        self, metric: Optional[str], mode: Optional[str], config: Dict, **spec
    ) -> bool:
        num_samples = spec.get("num_samples")
        if isinstance(num_samples, int) and num_samples > 0:
            self._budget = num_samples
        ok = super().set_search_properties(metric, mode, config, **spec)
        if self._own_sampler and self._budget and self.searcher.grid_size > 1 \
                and self._budget % self.searcher.grid_size:
            logger.warning(
                "param_space has a grid of %d points but num_samples=%d: with a "
                "Searcher, Tune runs num_samples trials in all, so the last pass "
                "over the grid is cut short. Use a multiple of %d.",
                self.searcher.grid_size, self._budget, self.searcher.grid_size)
        return ok

    def suggest(self, trial_id: str) -> Optional[Union[Dict, str]]:
        waiting = self._next()
        if waiting is None:
            if (self._exhausted or self._budget_spent()) and not self._book.waiting:
                return Searcher.FINISHED
            return None
        self._inner_id[trial_id] = waiting.item_id
        self._key_of[trial_id] = waiting.key
        self._unstarted[trial_id] = waiting.key
        self.live_trials.add(trial_id)
        self.num_unfinished_live_trials += 1
        self._top_up()
        self._publish()
        return copy.deepcopy(waiting.config)

    def on_trial_result(self, trial_id: str, result: Dict) -> None:
        inner = self._inner_id.get(trial_id)
        if inner is None:
            return
        if self._unstarted.pop(trial_id, None) is not None:
            self._publish()
        self.searcher.on_trial_result(inner, result)

    def on_trial_complete(
        self, trial_id: str, result: Optional[Dict] = None, error: bool = False
    ) -> None:
        inner = self._inner_id.pop(trial_id, None)
        if inner is None:
            return
        # Free the slot first: an inner searcher that raises must not leave
        # the slot taken for ever (the search would wait on it).
        self._book.complete(self._key_of.pop(trial_id))
        self._unstarted.pop(trial_id, None)
        self.live_trials.discard(trial_id)
        self.num_unfinished_live_trials -= 1
        self._publish()
        self.searcher.on_trial_complete(inner, result=result, error=error)

    def on_pause(self, trial_id: str) -> None:
        inner = self._inner_id.get(trial_id)
        if inner is not None:
            self.searcher.on_pause(inner)

    def on_unpause(self, trial_id: str) -> None:
        inner = self._inner_id.get(trial_id)
        if inner is not None:
            self.searcher.on_unpause(inner)

    # -- views ---------------------------------------------------------------
    def waiting_by_key(self) -> Dict[Hashable, int]:
        """Trials of each key still to join a bucket: held back, or released
        to Tune but with no result yet. What the compaction rule needs."""
        counts = self._book.waiting_by_key()
        for key in self._unstarted.values():
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def book(self) -> SlotBook:
        """The release/refill bookkeeping (read-only use)."""
        return self._book

    # -- the buffer ----------------------------------------------------------
    def _budget_spent(self) -> bool:
        return self._budget is not None and self._pulled >= self._budget

    def _next(self):
        busy = False  # the inner searcher said "not now" during this call
        while True:
            waiting = self._book.release(allow_new=False)  # refill first
            if waiting is not None:
                return waiting
            if (busy or self._exhausted or self._budget_spent()
                    or len(self._book.waiting) >= self.lookahead):
                return self._book.release(allow_new=True)
            if self._pull() is None:
                busy = True

    def _top_up(self) -> None:
        """Keep ``lookahead`` suggestions waiting while the budget lasts.

        So that the pool knows trials of a key are still coming: a bucket
        whose members were just pruned is then refilled, not compacted (the
        STOP retires members before Tune asks for the refill).
        """
        while (not self._exhausted and not self._budget_spent()
               and len(self._book.waiting) < self.lookahead):
            if self._pull() is None:
                return

    def _pull(self) -> Optional[bool]:
        """One suggestion from the inner searcher into the buffer.

        True: got one; False: the inner searcher is finished; None: not now.
        """
        item_id = f"{self._prefix}{self._pulled:05d}"
        config = self.searcher.suggest(item_id)
        if config == Searcher.FINISHED:
            self._exhausted = True
            return False
        if config is None:
            return None
        self._pulled += 1
        self._book.add(item_id, config, self._structural_key(item_id, config))
        return True

    def _structural_key(self, item_id: str, config: Dict) -> Hashable:
        if self._key_fn is None:
            return None
        try:
            return self._key_fn(config)
        except Exception:
            # The factory fails for this config: give it a key of its own, so
            # it starts alone and Tune reports the factory's error for it.
            logger.debug("structural key failed for %s", item_id, exc_info=True)
            return ("chorus/unbuildable", item_id)

    def _publish(self) -> None:
        """Tell the pool how many trials of each key are on their way.

        The pool's compaction rule (``grouping.should_compact``) must not
        shrink a bucket that a waiting trial would refill. Sent on every
        change (a release, a first result, a completion): the pool may not
        exist yet when the first trials are released. Guarded: without a pool
        module (or a pool) nobody needs the numbers.
        """
        counts = {k: v for k, v in self.waiting_by_key().items() if v}
        try:
            from chorus_tune.tune.pool import get_pool, set_waiting
        except ImportError:
            return
        try:
            if self._task is not None and not self._pool_ready and ray.is_initialized():
                # A chorus sweep: start the pool now, so it hears the counts
                # before the first cohort is pruned (ChorusASHA retires
                # members before Tune tells the search about that result).
                get_pool(create=True)
                self._pool_ready = True
            set_waiting(counts)
        except Exception:
            logger.debug("pool.set_waiting failed", exc_info=True)

    # -- save / restore ------------------------------------------------------
    _NOT_SAVED = ("searcher", "_task", "_key_fn", "_pool_ready")

    def get_state(self) -> Dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_SAVED}
        return copy.deepcopy(state)

    def set_state(self, state: Dict) -> None:
        self.__dict__.update(state)
        self._pool_ready = False

    def save(self, checkpoint_path: str) -> None:
        """Buffer, id maps and the inner searcher's own state, in one file."""
        with tempfile.TemporaryDirectory() as tmp:
            inner_path = os.path.join(tmp, "inner")
            inner_bytes = None
            try:
                self.searcher.save(inner_path)
                with open(inner_path, "rb") as f:
                    inner_bytes = f.read()
            except NotImplementedError:
                logger.warning("%s cannot save its state", type(self.searcher).__name__)
        with open(checkpoint_path, "wb") as f:
            cloudpickle.dump({"chorus": self.get_state(), "inner": inner_bytes}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            saved = pickle.load(f)
        self.set_state(saved["chorus"])
        if saved["inner"] is not None:
            with tempfile.TemporaryDirectory() as tmp:
                inner_path = os.path.join(tmp, "inner")
                with open(inner_path, "wb") as f:
                    f.write(saved["inner"])
                self.searcher.restore(inner_path)
