"""A member's seed, read from its config with an error that names the key.

Torch-free on purpose: Tune's trial actors (which never import torch) read
seeds too. :func:`chosen_seed` is the one rule every reader follows: the
bucket, the reference and the Tune layer.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Mapping

SEED_KEY = "seed"


def as_seed(value: Any, what: str = f"config key {SEED_KEY!r}") -> int:
    """``value`` as an integer seed, or a ``ValueError`` that names ``what``.

    Integers of any kind (numpy's too) are taken as they are; so are floats
    with an integral value (``tune.quniform`` gives ``3.0``) and strings of an
    integer (``"7"``). Anything else, a bool or ``3.5`` included, is refused
    rather than truncated: two trials seeded 3.2 and 3.7 would otherwise
    silently share a seed.
    """
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
        if isinstance(value, numbers.Real) and float(value).is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    raise ValueError(f"{what} must be an integer (it seeds the model's initial weights and the batch "
                     f"order); got {value!r} of type {type(value).__name__}")


def config_seed(config: Mapping[str, Any]) -> int | None:
    """The config's ``seed`` as an int; ``None`` when it has none (or ``None``)."""
    value = config.get(SEED_KEY)
    return None if value is None else as_seed(value)


def chosen_seed(config: Mapping[str, Any], given: Any = None, otherwise: Callable[[], int] | None = None) -> int:
    """A member's seed: ``given``, else the config's ``seed``, else
    ``otherwise()`` (a fresh one in a bucket, one derived from the trial id in
    the Tune layer); with neither, a ``ValueError`` that asks for one. A
    ``seed`` of ``None`` in the config counts as none."""
    if given is not None:
        return as_seed(given, SEED_KEY)
    from_config = config_seed(config)
    if from_config is not None:
        return from_config
    if otherwise is None:
        raise ValueError(f"a seed is needed: pass seed= or put {SEED_KEY!r} in the config")
    return as_seed(otherwise(), SEED_KEY)
