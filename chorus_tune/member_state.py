"""What a portable member state holds (docs/design.md D7), checked with errors
that say what is wrong instead of a bare ``KeyError``.

A member state is what ``Bucket.member_state(slot)`` returns and what a
``ChorusTrainable`` checkpoint carries: everything that makes a member itself,
so it can be put into any slot of any bucket of the same structure. Torch-free:
the check reads keys only.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Mapping

from .seeds import as_seed

# What Bucket.add reads from a state, and what each key holds.
MEMBER_STATE_KEYS = {
    "config": "the member's config",
    "seed": "its seed",
    "model": "its model's state_dict, in the user's own key names",
    "optimizer": "its optimizer state (family, step, per-parameter tensors)",
    "iteration": "the iterations it has trained",
    "step": "the optimizer steps it has taken",
}
# Present in every state Bucket.member_state writes, but not needed to load one.
OPTIONAL_KEYS = ("format", "data")
OPTIMIZER_STATE_KEYS = ("step", "tensors")

_WHAT_IT_IS = ("A member state is what Bucket.member_state(slot) returns (and what a ChorusTrainable "
               "checkpoint carries): a dict with keys " + ", ".join(repr(k) for k in MEMBER_STATE_KEYS)
               + " and 'data'.")


def _looks_like_state_dict(state: Mapping) -> bool:
    return bool(state) and all(hasattr(v, "shape") and hasattr(v, "dtype") for v in state.values())


def _keys(mapping: Mapping, limit: int = 8) -> str:
    names = [repr(k) for k in list(mapping)[:limit]]
    return ", ".join(names) + (", ..." if len(mapping) > limit else "") if names else "none"


def check_member_state(state: Any) -> None:
    """Raise a ``ValueError`` (``TypeError`` for a non-dict) saying why
    ``state`` is not a chorus member state; return ``None`` if it is one."""
    if not isinstance(state, Mapping):
        raise TypeError(f"not a chorus member state: expected a dict, got {type(state).__name__}. {_WHAT_IT_IS}")
    missing = [k for k in MEMBER_STATE_KEYS if k not in state]
    if missing:
        hint = ""
        if _looks_like_state_dict(state):
            hint = (" It looks like a model's state_dict: a member state holds that under 'model', next to the "
                    "optimizer state and step counts; load a plain state_dict with module.load_state_dict.")
        raise ValueError(f"not a chorus member state: missing key(s) {', '.join(repr(k) for k in missing)} "
                         f"(it has {_keys(state)}).{hint} {_WHAT_IT_IS}")
    if not isinstance(state["config"], Mapping):
        raise ValueError(f"member state 'config' must be a dict; got {type(state['config']).__name__}")
    if not isinstance(state["model"], Mapping):
        raise ValueError(f"member state 'model' must be a state_dict (a dict of tensors); "
                         f"got {type(state['model']).__name__}")
    optimizer = state["optimizer"]
    if not isinstance(optimizer, Mapping) or any(k not in optimizer for k in OPTIMIZER_STATE_KEYS):
        has = _keys(optimizer) if isinstance(optimizer, Mapping) else type(optimizer).__name__
        raise ValueError(f"member state 'optimizer' must be a StackedOptimizer.member_state dict with keys "
                         f"{', '.join(repr(k) for k in OPTIMIZER_STATE_KEYS)}; got {has}")
    data = state.get("data")
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(f"member state 'data' must be a batch order's state_dict, or None; got {type(data).__name__}")
    as_seed(state["seed"], "member state 'seed'")
    for key in ("iteration", "step"):
        if not _is_count(state[key]):
            raise ValueError(f"member state {key!r} must be a non-negative integer; got {state[key]!r}")


def _is_count(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return isinstance(value, numbers.Real) and float(value).is_integer() and value >= 0


def check_state_fits(state: Mapping, family: str, module: Any) -> None:
    """Raise a ``ValueError`` naming what does not fit, before anything is
    loaded, when a member state (checked by :func:`check_member_state`) is
    not one of ``module``'s structure trained with optimizer ``family``: its
    optimizer state of another family (a bare ``KeyError: 'momentum_buffer'``
    before), or a model or optimizer tensor missing, extra or of another
    shape."""
    from .optim import optimizer_family  # torch: only here, where a bucket loads the state

    optimizer = state["optimizer"]
    saved_family = optimizer.get("family", family)
    if saved_family != family:
        raise ValueError(f"member state's optimizer state is {saved_family!r}'s, but this member trains with "
                         f"{family!r} (its config's 'optimizer', else the task's): restore it with a config of "
                         f"optimizer={saved_family!r}, into a bucket of that family")
    shapes = {k: tuple(getattr(v, "shape", ())) for k, v in module.state_dict().items()}
    _check_tensors("'model'", state["model"], shapes)
    tensors = optimizer["tensors"]
    if not isinstance(tensors, Mapping):
        raise ValueError(f"member state 'optimizer' 'tensors' must be a dict; got {type(tensors).__name__}")
    names = optimizer_family(family).state_names
    for name, parameter in module.named_parameters():
        saved = tensors.get(name)
        if not isinstance(saved, Mapping):
            raise ValueError(f"member state 'optimizer' has no state for parameter {name!r} (it has "
                             f"{_keys(tensors)}): not a state of this model's structure")
        _check_tensors(f"'optimizer' for {name!r}", saved, {s: tuple(parameter.shape) for s in names})


def _check_tensors(what: str, saved: Mapping, expected: Mapping[str, tuple]) -> None:
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    if missing or extra:
        raise ValueError(f"member state {what} does not fit this model: missing {_keys(dict.fromkeys(missing))}, "
                         f"unexpected {_keys(dict.fromkeys(extra))}. A member state restores only into a bucket "
                         "of the model and optimizer it was saved from")
    for key, shape in expected.items():
        got = tuple(getattr(saved[key], "shape", ()))
        if got != shape:
            raise ValueError(f"member state {what}: {key!r} has shape {got}, but this model's is {shape}: "
                             "a member state restores only into a bucket of the model it was saved from")
