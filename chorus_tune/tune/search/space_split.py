"""How a sweep's trials split into structures, in words (docs/design.md D9; Ray-free).

Members share a bucket only when their sharing keys are equal
(``chorus_tune.stack.sharing_key``): a config key that changes a parameter
shape other than a width that pads (docs/design.md D9), widths that would
pad past the width rule's factor, the batch size or the optimizer family
splits the sweep. Widths of Linear, Conv, BatchNorm and Embedding layers
within the factor do not: those members share a padded bucket. The widths
are grouped as the pool groups them, in the sample's order, as for a CPU
(the driver does not know the buckets' device; on a GPU small models pad
further, so a sweep splits no more than said). A user who
sweeps such a key should hear it when the run starts, not find ``chorus/live``
at 1 afterwards. :func:`split_of` reads a sample of the run's configs and says
how many structures they fall into and which keys split them, by asking the
key itself: a config key splits when changing it alone (from one config of
the sample) changes the sharing key. Models are built on the ``meta``
device, so this costs no memory and no initialisation.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
import ray.cloudpickle as cloudpickle

from chorus_tune.config_keys import is_tune_key
from chorus_tune.stack import describe_split, sharing_key
from chorus_tune.tune.rules.solo import may_train_solo
from chorus_tune.width_rule import WidthGroups
from chorus_tune.widths import PaddingPrices

# Values of one key tried against the base config: enough to see that a key splits.
_VALUES_TRIED = 8

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpaceSplit:
    """``trials`` configs in ``structures`` structures (``sizes``: trials per
    structure, largest first); ``splitting``: each config key that splits,
    with the distinct values it takes in the sample; ``why``: what differs
    between the structures (``describe_split``'s words), ``unbuildable``:
    configs whose model could not be built (their trials will say why)."""

    trials: int
    structures: int
    sizes: tuple[int, ...]
    splitting: tuple[tuple[str, int], ...]
    why: str = ""
    unbuildable: int = 0

    @property
    def fuses(self) -> bool:
        """Whether any two trials of the sample can share a bucket."""
        return any(size > 1 for size in self.sizes)

    def message(self, bucket_size: int | None = None, solo: bool = False) -> str:
        """One line for the run's log. ``solo``: a member seated alone trains in
        its trial's own process (chorus_tune.tune.rules.solo), not in a bucket."""
        if self.structures <= 1:
            return f"{self.trials} trials share one structure: they fuse" + (
                f" in buckets of up to {bucket_size}" if bucket_size else "")
        keys = ", ".join(f"{name} takes {count} values" for name, count in self.splitting) or "no config key alone"
        line = f"{self.trials} trials fall into {self.structures} structures ({keys}"
        line += f"; {self.why})" if self.why else ")"
        if not self.fuses:
            return line + (": nothing will fuse, every trial trains alone in its own process, as plain Tune "
                           "would" if solo else ": nothing will fuse, every trial trains in a bucket of its own")
        largest = self.sizes[0]
        return line + (f": the largest structure holds {largest} of them, the smallest {self.sizes[-1]}; "
                       "each structure fuses only within itself")


def split_of(task: Any, configs: Sequence[dict], input_row: Callable[[], Any] | None = None) -> SpaceSplit:
    """How ``configs`` (a sample of the run's, Tune's ``__`` keys allowed)
    split into structures for ``task``, widths priced as the pool prices them
    (multiply-adds, with one input row of the task's data, ``input_row()``,
    by default ``task.input_row``: asked only if the sample's widths differ)."""
    groups, prices = WidthGroups(), PaddingPrices(input_row or task.input_row)
    keys: list[Any] = []
    built: list[dict] = []
    for config in configs:
        try:
            keys.append(sharing_key(task, config, groups, prices))
        except Exception:  # noqa: BLE001 - a config that cannot build fails its own trial, with its own error
            continue
        built.append(config)
    sizes = tuple(sorted(Counter(keys).values(), reverse=True))
    splitting, why = _splitting_keys(task, built, keys, prices)
    return SpaceSplit(trials=len(configs), structures=len(sizes), sizes=sizes, splitting=splitting, why=why,
                      unbuildable=len(configs) - len(built))


def _splitting_keys(task: Any, configs: list[dict], keys: list[Any],
                    prices: PaddingPrices) -> tuple[tuple[tuple[str, int], ...], str]:
    if len(set(keys)) <= 1:
        return (), ""
    base, base_key = configs[0], keys[0]
    splitting: list[tuple[str, int]] = []
    for name in sorted({k for c in configs for k in c if not is_tune_key(k)}, key=str):
        values = _distinct([c[name] for c in configs if name in c])
        if len(values) < 2:
            continue
        for value in values[:_VALUES_TRIED]:
            try:
                if _apart(task, base, {**base, name: value}, prices):
                    splitting.append((str(name), len(values)))
                    break
            except Exception:  # noqa: BLE001 - a combination no trial asked for may not build
                continue
    other = next(k for k in keys if k != base_key)
    return tuple(splitting), describe_split(base_key, other)


def _apart(task: Any, base: dict, other: dict, prices: PaddingPrices) -> bool:
    """Whether ``other`` cannot share a bucket with ``base``, the two alone."""
    groups = WidthGroups()
    return sharing_key(task, base, groups, prices) != sharing_key(task, other, groups, prices)


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    seen: set[str] = set()
    for value in values:
        marker = repr(value)
        if marker not in seen:
            seen.add(marker)
            out.append(value)
    return out


# Configs drawn to say how a space splits into structures (at most; fewer when
# num_samples is smaller): meta-device builds, about 1 ms each.
_SPLIT_SAMPLE = 64


def _row_from_the_pool(task: Any, task_id: str, task_blob: bytes) -> Callable[[], Any]:
    def input_row() -> Any:
        from chorus_tune.tune import client

        row = client.input_row(task_id, task_blob)
        return row if row is not None else task.input_row()

    return input_row


def say_how_it_splits(task_blob: bytes, config: dict, num_samples: Any, bucket_size: int,
                      options: Any = None, task_id: str | None = None) -> None:
    """Tell the user, as the run starts, how its trials fall into structures
    and what splits them (a WARNING when they do not all fuse): a width or
    batch-size sweep otherwise shows only as ``chorus/live`` 1 afterwards.
    ``options``: the run's BucketOptions, which say (with the cluster) whether
    members seated alone train in their trials' own processes (rules/solo.py).
    Read off a sample of the space drawn apart from the run's own (its draws
    are untouched); never fails the run. ``task_id``: the pool's name for the
    task: where widths differ, padding is priced with the input row of the
    pool's load of the data (loaded here otherwise, a second load beside the
    run's start)."""
    try:
        from .sampler import SpaceSampler

        task = cloudpickle.loads(task_blob)
        n = num_samples if isinstance(num_samples, int) and 0 < num_samples <= _SPLIT_SAMPLE else _SPLIT_SAMPLE
        sampler = SpaceSampler(random_state=0)
        sampler.set_search_properties(None, None, config)
        split = split_of(task, [sampler.suggest(str(i)) for i in range(n)],
                         None if task_id is None else _row_from_the_pool(task, task_id, task_blob))
    except Exception:  # noqa: BLE001 - a report, not a check: the trials say what fails
        logger.debug("ChorusSearch: could not read how the space splits", exc_info=True)
        return
    level = logging.WARNING if split.structures > 1 else logging.INFO
    solo = options is not None and ray.is_initialized() and may_train_solo(ray.cluster_resources(), options)
    logger.log(level, "ChorusSearch: %s", split.message(bucket_size, solo))
