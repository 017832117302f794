"""Sampling ``param_space`` as Tune's default generator does, for ``ChorusSearch``
without a searcher (grid points in Tune's order, random axes drawn afresh)."""
from __future__ import annotations

import copy
from typing import Dict, List, Optional

import numpy as np
import ray.cloudpickle as cloudpickle
from ray.tune.search import Searcher
from ray.tune.search.variant_generator import generate_variants


def grid_size(space: Dict) -> int:
    """How many points one pass over ``space``'s ``grid_search`` axes has (1 without any)."""
    return sum(1 for _ in generate_variants({"config": copy.deepcopy(space)},
                                            random_state=np.random.default_rng(0)))


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

    def set_search_properties(
        self, metric: Optional[str], mode: Optional[str], config: Dict, **spec
    ) -> bool:
        self._space = copy.deepcopy(config) if config else None
        self._pass = []
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
