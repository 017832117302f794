"""A member's module configuration, and the settings a stack gives each member (docs/design.md D9).

Members of one bucket run through one *template* skeleton on the fused routes.
Shapes alone do not make that safe: ``nn.Dropout(0.9)`` and ``nn.Dropout(0.0)``
have the same (no) tensors, and so do ``nn.ReLU`` and ``nn.Tanh``. So the
structural key also holds each submodule's **configuration**: its type and its
non-tensor settings (plain scalar attributes, and what ``extra_repr`` shows).

Some settings the stack can give each member instead (**lifted**): the
template's module is swapped for one that reads the setting from a stacked
``(K,)`` tensor, one value per member, under ``torch.vmap``. Lifted settings
are left out of the key, so members that differ only in them share a bucket.
Everything else that differs splits the bucket (:func:`describe_difference`
says what). :data:`LIFTS` is the list of what is lifted.

What no configuration shows (a rate read from a global, a flag kept in a dict
attribute, a forward hook) stays the route probe's to catch (D8): the probe
runs dropout deterministically as ``x * (1 - p)`` (:func:`deterministic_dropout`),
so a fused route that reads another member's rate disagrees with the
per-member loop.
"""
from __future__ import annotations

import contextlib
import enum
import math
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

# One entry per submodule: (path, "module.QualifiedType", ((setting, value text), ...)).
ModuleConfiguration = tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]

# SELU's negative saturation constant, as torch's alpha dropout uses it (aten Dropout.cpp).
_ALPHA = 1.7580993408473766


# ----- the lifted modules: each reads its setting from a buffer that the stack fills per member --------
def member_dropout(x: torch.Tensor, p: torch.Tensor, training: bool, feature: int | None) -> torch.Tensor:
    """Dropout at rate ``p`` (a tensor: under vmap, each member's own).

    ``feature``: ``None`` drops elements; else whole channels, for inputs of
    ``feature`` dimensions or more (a smaller input is unbatched: its channels
    are its first dimension), as ``F.dropout1d/2d/3d`` do. ``p = 0`` returns
    ``x`` unchanged to the bit; ``p = 1`` returns zeros, as torch does.
    """
    if not training:
        return x
    keep = torch.rand_like(_noise_view(x, feature)) >= p  # P(keep) = 1 - p; rand is in [0, 1)
    scale = torch.where(p < 1, 1 / (1 - p), torch.zeros_like(p))
    return x * (keep.to(x.dtype) * scale.to(x.dtype))


def member_alpha_dropout(x: torch.Tensor, p: torch.Tensor, training: bool, feature: int | None) -> torch.Tensor:
    """Alpha dropout at rate ``p`` (a tensor), the arithmetic of torch's
    ``alpha_dropout`` / ``feature_alpha_dropout`` with ``p`` per member."""
    if not training:
        return x
    keep = (torch.rand_like(_noise_view(x, feature)) >= p).to(x.dtype)
    safe = torch.where(p < 1, p, torch.zeros_like(p))  # p = 1 would divide by zero; its output is zeros anyway
    a = 1 / torch.sqrt((_ALPHA * _ALPHA * safe + 1) * (1 - safe))
    b = (keep - 1) * (_ALPHA * a) + _ALPHA * a * safe
    out = x * (keep * a) + b
    return torch.where(p < 1, out, torch.zeros_like(out))


def _noise_view(x: torch.Tensor, feature: int | None) -> torch.Tensor:
    if feature is None or x.dim() < 2:
        return x
    # Channel dropout: one draw per (sample, channel), broadcast over the rest.
    # An input below ``feature`` dims is unbatched: one draw per channel (dim 0).
    lead = 2 if x.dim() >= feature else 1
    return x[(slice(None),) * lead + (slice(0, 1),) * (x.dim() - lead)]


class _LiftedDropout(nn.Module):
    """A dropout module of the template whose rate ``p`` is a buffer: the
    stack's ``(K,)`` row of rates, so each member drops at its own rate."""

    def __init__(self, source: nn.Module, feature: int | None, alpha: bool):
        super().__init__()
        self.register_buffer("p", torch.tensor(float(source.p)), persistent=False)
        self.feature, self.alpha, self.source_type = feature, alpha, type(source).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Looked up at call time (module globals): the route probe swaps them (deterministic_dropout).
        impl = member_alpha_dropout if self.alpha else member_dropout
        return impl(x, self.p, self.training, self.feature)

    def extra_repr(self) -> str:
        return f"{self.source_type}, p per member"


def member_leaky_relu(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """LeakyReLU with ``slope`` a tensor (each member's own, under vmap or broadcast over a stack)."""
    return torch.where(x > 0, x, x * slope.to(x.dtype))


def member_elu(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """ELU with ``alpha`` a tensor (each member's own, under vmap or broadcast over a stack)."""
    return torch.where(x > 0, x, alpha.to(x.dtype) * torch.expm1(x))


class _LiftedLeakyReLU(nn.Module):
    """LeakyReLU with a per-member ``negative_slope`` (exactly ``F.leaky_relu``'s
    values and gradients: ``x`` where ``x > 0``, else ``slope * x``)."""

    def __init__(self, source: nn.LeakyReLU):
        super().__init__()
        self.register_buffer("negative_slope", torch.tensor(float(source.negative_slope)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return member_leaky_relu(x, self.negative_slope)


class _LiftedELU(nn.Module):
    """ELU with a per-member ``alpha``: ``x`` where ``x > 0``, else ``alpha * expm1(x)``."""

    def __init__(self, source: nn.ELU):
        super().__init__()
        self.register_buffer("alpha", torch.tensor(float(source.alpha)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return member_elu(x, self.alpha)


def is_lifted(module: nn.Module) -> bool:
    """Whether ``module`` is one :func:`lift` put in (it reads per-member settings)."""
    return type(module) in (_LiftedDropout, _LiftedLeakyReLU, _LiftedELU)


def stack_form(module: nn.Module) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]] | None:
    """For a lifted module that acts on each element alone: the names of its
    settings and its forward on a stack of members, ``fn(x, *settings)`` with
    ``x`` ``(K, ...)`` and each setting ``(K,)`` (chorus_tune/batched.py runs
    it without vmap). ``None`` for the others: channel and alpha dropout
    draw or shift per channel, which a stack's extra leading dimension moves."""
    if type(module) is _LiftedDropout and module.feature is None and not module.alpha:
        # member_dropout looked up at call time, as the lifted module does: the
        # route probe swaps it for its deterministic form (deterministic_dropout).
        return ("p",), lambda x, p: _THIS.member_dropout(x, _per_member(p, x), module.training, None)
    if type(module) is _LiftedLeakyReLU:
        return ("negative_slope",), lambda x, slope: member_leaky_relu(x, _per_member(slope, x))
    if type(module) is _LiftedELU:
        return ("alpha",), lambda x, alpha: member_elu(x, _per_member(alpha, x))
    return None


def _per_member(setting: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ``(K,)`` setting shaped to broadcast over a ``(K, ...)`` stack."""
    return setting.reshape(-1, *([1] * (x.dim() - 1)))


@dataclass(frozen=True)
class Lift:
    """A module type whose ``settings`` the stack gives each member, and how
    the template's module is swapped for one that reads them per member."""

    settings: tuple[str, ...]
    build: Callable[[nn.Module], nn.Module]


# Exact types only: a user's subclass may have a forward of its own, so it is
# not swapped (its settings stay configuration and split buckets instead).
# An ``inplace`` flag stays configuration: the lifted modules compute out of
# place, which gives the same values and gradients.
LIFTS: dict[type, Lift] = {
    nn.Dropout: Lift(("p",), lambda m: _LiftedDropout(m, None, alpha=False)),
    nn.Dropout1d: Lift(("p",), lambda m: _LiftedDropout(m, 3, alpha=False)),
    nn.Dropout2d: Lift(("p",), lambda m: _LiftedDropout(m, 2, alpha=False)),
    nn.Dropout3d: Lift(("p",), lambda m: _LiftedDropout(m, 5, alpha=False)),
    nn.AlphaDropout: Lift(("p",), lambda m: _LiftedDropout(m, None, alpha=True)),
    nn.FeatureAlphaDropout: Lift(("p",), lambda m: _LiftedDropout(m, 2, alpha=True)),
    nn.LeakyReLU: Lift(("negative_slope",), _LiftedLeakyReLU),
    nn.ELU: Lift(("alpha",), _LiftedELU),
}


# ----- the configuration signature -------------------------------------------------------------
def _setting_text(value: Any) -> str | None:
    """How a setting reads in the key, or ``None`` for what the key cannot
    compare (tensors are the stack's; other objects are left to the probe)."""
    if value is None or isinstance(value, (bool, int, str, enum.Enum)):
        return repr(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, (tuple, list)):
        items = [_setting_text(v) for v in value]
        return None if any(i is None for i in items) else f"({', '.join(items)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):  # e.g. an activation function
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return None


def module_configuration(module: nn.Module) -> ModuleConfiguration:
    """Every submodule's path, type and settings, lifted settings left out.

    Settings: each public attribute in the module's ``__dict__`` that is a
    plain value (number, bool, string, None, enum, dtype, tuple of these, a
    function), except ``training`` and the settings :data:`LIFTS` lifts for
    its type; and, for a type not lifted, its ``extra_repr()``. Works on a
    model built on the ``meta`` device.
    """
    out = []
    for path, sub in module.named_modules():
        kind = type(sub)
        lift = LIFTS.get(kind)
        lifted = lift.settings if lift is not None else ()
        settings = []
        for name, value in sorted(vars(sub).items()):
            if name.startswith("_") or name == "training" or name in lifted:
                continue
            text = _setting_text(value)
            if text is not None:
                settings.append((name, text))
        if lift is None:  # a lifted (torch) type's extra_repr shows only its attributes, the lifted ones too
            try:
                extra = sub.extra_repr()
            except Exception:  # noqa: BLE001 - a repr that cannot run on this build: the probe still judges
                extra = ""
            if extra:
                settings.append(("extra_repr", extra))
        out.append((path, f"{kind.__module__}.{kind.__qualname__}", tuple(settings)))
    return tuple(out)


def lifted_settings(module: nn.Module) -> dict[str, float]:
    """The member's values of every lifted setting, by ``"<module path>.<setting>"``
    (the name of the template's buffer that carries it)."""
    out = {}
    for path, sub in module.named_modules():  # a module used twice is one setting, under its first path
        lift = LIFTS.get(type(sub))
        if lift is not None:
            for name in lift.settings:
                out[f"{path}.{name}" if path else name] = float(getattr(sub, name))
    return out


def lift(template: nn.Module) -> nn.Module:
    """``template`` (modified in place, and returned) with each lifted module
    swapped for one that reads its settings per member from buffers named as
    in :func:`lifted_settings`."""
    if type(template) in LIFTS:
        return LIFTS[type(template)].build(template)
    built: dict[int, nn.Module] = {}  # a module used twice stays one module (one setting), tied
    for sub in list(template.modules()):
        for child_name, child in list(sub.named_children()):
            if type(child) in LIFTS:
                if id(child) not in built:
                    built[id(child)] = LIFTS[type(child)].build(child)
                setattr(sub, child_name, built[id(child)])
    return template


def describe_difference(ours: ModuleConfiguration, theirs: ModuleConfiguration, limit: int = 3) -> str:
    """The first few settings in which two configurations differ, in words."""
    if len(ours) != len(theirs):
        return f"{len(ours)} submodules vs {len(theirs)}"
    diffs = []
    for (path, kind, settings), (path2, kind2, settings2) in zip(ours, theirs):
        where = f"module {path or '(root)'!r}"
        if path != path2:
            diffs.append(f"submodule {path!r} vs {path2!r}")
        elif kind != kind2:
            diffs.append(f"{where}: {kind.rsplit('.', 1)[-1]} vs {kind2.rsplit('.', 1)[-1]}")
        elif settings != settings2:
            a, b = dict(settings), dict(settings2)
            for name in sorted(set(a) | set(b)):
                if a.get(name) != b.get(name):
                    diffs.append(f"{where} ({kind.rsplit('.', 1)[-1]}).{name}: {a.get(name, '-')} vs "
                                 f"{b.get(name, '-')}")
    if not diffs:
        return "no difference"
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def describe_lifted() -> str:
    """What the stack gives each member, in words (for logs and reports)."""
    return ", ".join(f"{kind.__name__}.{'/'.join(lift.settings)}" for kind, lift in LIFTS.items())


# ----- the probe's dropout ---------------------------------------------------------------------------
def _probe_dropout(input: torch.Tensor, p: Any = 0.5, training: bool = True, inplace: bool = False,
                   *args: Any) -> torch.Tensor:
    return input * (1 - p) if training else input


def _probe_member_dropout(x: torch.Tensor, p: torch.Tensor, training: bool, feature: int | None) -> torch.Tensor:
    return x * (1 - p).to(x.dtype) if training else x


def _probe_sdpa(original: Callable) -> Callable:
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        return original(query, key, value, attn_mask, 0.0, is_causal, **kwargs) * (1 - dropout_p)
    return sdpa


def _in_thread(owner: int, probe: Callable, original: Callable) -> Callable:
    # Only the probing thread sees the probe's dropout: another thread of the
    # process (another bucket, the user's own model) keeps real dropout.
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (probe if threading.get_ident() == owner else original)(*args, **kwargs)
    return dispatch


@contextlib.contextmanager
def deterministic_dropout() -> Iterator[None]:
    """Within, in this thread: every dropout runs as ``x * (1 - p)`` in train
    mode, with the rate its module reads (stock modules and ``F.dropout``
    calls their own float, lifted modules the stack's per-member value,
    attention its ``dropout_p``).

    For the route probe (docs/design.md D8): random masks always differ
    between routes, so dropout was switched off there, and then a fused route
    that ran a member at another member's rate looked correct. Deterministic
    and still a function of the rate, the probe compares the rates in effect.
    """
    owner = threading.get_ident()
    probes: list[tuple[Any, str, Callable]] = [
        (F, name, _probe_dropout)
        for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")]
    probes.append((F, "scaled_dot_product_attention", _probe_sdpa(F.scaled_dot_product_attention)))
    probes += [(_THIS, name, _probe_member_dropout) for name in ("member_dropout", "member_alpha_dropout")]
    saved = [(target, name, getattr(target, name)) for target, name, _ in probes]
    try:
        for (target, name, probe), (_, _, original) in zip(probes, saved):
            setattr(target, name, _in_thread(owner, probe, original))
        yield
    finally:
        for target, name, original in saved:
            setattr(target, name, original)


_THIS = sys.modules[__name__]
