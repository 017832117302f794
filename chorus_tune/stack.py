"""K modules of one structure as stacked tensors, and the routes through them.

``MemberStack`` holds every parameter and buffer of ``capacity`` members as one
``(capacity, ...)`` tensor each. The *vmap* route runs them all in one call
(``torch.func.functional_call`` under ``torch.vmap``), the *compiled* route
runs that call under ``torch.compile``, and the *eager* route runs each
member's own module in a loop over views of the same storage. All write
BatchNorm running statistics in place into the stacked buffers.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from .batched import BatchedEligibility, batched_forward
from .compiling import CompiledCalls
from .configuration import ModuleConfiguration, describe_difference, lift, lifted_settings, module_configuration
from .losses import LossFn
from .rows import RowCopies, copy_rows, put_rows
from .widths import Shape, corner, describe_paddable, pad_into, pad_mask, padding_family, shapes_of

Tensors = dict[str, torch.Tensor]


class StructuralKey(NamedTuple):
    """Who may share a bucket (docs/design.md D9): members whose keys are equal."""

    model_class: str  # "module.QualifiedName" of the model
    parameters: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) of each parameter
    buffers: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) of each buffer
    batch_size: int
    optimizer: str  # the optimizer family's name
    loss: str
    data: str  # "static", or the data callable's qualified name
    # Every submodule's type and settings, the per-member (lifted) ones left out
    # (chorus_tune/configuration.py): who may share the vmap template.
    configuration: ModuleConfiguration = ()
    # A sharing key's width group (width_rule.WidthGroups; :func:`sharing_key`):
    # None in a member's own key, whose shapes say its widths.
    width_group: int | None = None


def describe_split(ours: StructuralKey, theirs: StructuralKey) -> str:
    """Why members of these two keys cannot share a bucket, in words. Widths
    that pad (chorus_tune/widths.py) are no split: keys that differ only in
    them are of one padded family, and whether those share is the sharing
    rule's to say (chorus_tune/width_rule.py)."""
    ours, theirs = padding_family(ours), padding_family(theirs)
    fields = [f for f in StructuralKey._fields if getattr(ours, f) != getattr(theirs, f)]
    if not fields:
        return "they differ only in widths, which pad (docs/design.md D9)"
    parts = []
    if "configuration" in fields:
        parts.append("their module configurations differ in settings the stack cannot give each member: "
                     + describe_difference(ours.configuration, theirs.configuration))
    if "parameters" in fields or "buffers" in fields:
        parts.append(f"their shapes differ in {', '.join(_unpaddable_widths(ours, theirs))}, which cannot pad "
                     f"(only the widths of {describe_paddable()} do)")
    if "width_group" in fields and ours.width_group is not None and theirs.width_group is not None:
        parts.append("their widths would cost more padded together than the width rule allows "
                     "(chorus_tune/width_rule.py)")
    names = {"model_class": "model class", "batch_size": "batch size", "optimizer": "optimizer family",
             "loss": "loss", "data": "data"}
    others = [names[f] for f in fields if f in names]
    if others:
        parts.append("their " + ", ".join(others) + " differ")
    # Nothing but a width group against a key without one (a member's own key): widths, which pad.
    return "; ".join(parts) or "they differ only in widths, which pad (docs/design.md D9)"


def _unpaddable_widths(ours: StructuralKey, theirs: StructuralKey, limit: int = 3) -> list[str]:
    differ = [f"{n} {tuple(s)} vs {tuple(s2)}" for (n, s, _), (_, s2, _) in
              zip((*ours.parameters, *ours.buffers), (*theirs.parameters, *theirs.buffers)) if s != s2]
    return differ[:limit] + ([f"{len(differ) - limit} more"] if len(differ) > limit else [])


def structural_key(task, config: dict) -> StructuralKey:
    """Who may share a bucket (docs/design.md D9): same class, parameter and buffer
    names/shapes/dtypes, batch size, optimizer family, loss, data, and module
    configuration (each submodule's type and the settings the stack does not
    give each member: chorus_tune/configuration.py).

    The model is built on the ``meta`` device: no memory, no initialisation
    cost. Raises what the model factory raises.
    """
    return module_key(task, config, _meta_model(task, config))


def _meta_model(task, config: dict) -> nn.Module:
    try:
        with torch.device("meta"):
            return task.model(config)
    except Exception:
        # Some factories cannot run on meta (they read data or call .item());
        # a real build gives the same shapes, or the factory's real error.
        return task.build_model(config, seed=0)


def sharing_key(task, config: dict, groups, prices=None) -> StructuralKey:
    """Who may share a bucket, widths padding (docs/design.md D9): the config's
    structural key with its widths left out (``widths.padding_family``) and its
    width group in ``groups`` (a ``width_rule.WidthGroups``, which remembers
    the widths it was shown, in order) in their place, priced by ``prices``
    (a ``widths.PaddingPrices``: multiply-adds per sample) or, without,
    by parameters. Members of equal sharing keys share padded buckets: what
    the pool groups trials by, and what ``space_split`` counts."""
    from .widths import parameter_cost

    key = structural_key(task, config)
    family = padding_family(key)
    cost = parameter_cost(key) if prices is None else prices.cost(family, key, lambda: _meta_model(task, config))
    group = groups.assign(family, shapes_of(key), cost, key.batch_size)
    return family._replace(width_group=group)


def module_key(task, config: dict, module: nn.Module) -> StructuralKey:
    """The structural key of ``config``, read off a model already built from it."""
    cls = type(module)
    loss = task.loss if isinstance(task.loss, str) else f"{task.loss.__module__}.{task.loss.__qualname__}"
    data = "static" if not callable(task.data) else f"{task.data.__module__}.{getattr(task.data, '__qualname__', '')}"
    return StructuralKey(
        model_class=f"{cls.__module__}.{cls.__qualname__}",
        parameters=tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()),
        buffers=tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()),
        batch_size=task.batch_size_for(config),
        optimizer=task.optimizer_for(config),
        loss=loss,
        data=data,
        configuration=module_configuration(module),
    )


def module_tensors(module: nn.Module) -> tuple[Tensors, Tensors]:
    return dict(module.named_parameters()), dict(module.named_buffers())


def module_shapes(module: nn.Module) -> dict[str, Shape]:
    """``{name: shape}`` of every parameter and buffer of ``module``."""
    return {n: tuple(t.shape) for n, t in (*module.named_parameters(), *module.named_buffers())}


class _RowsIn(NamedTuple):
    """The tensors a fused call reads (``MemberStack._rows_in``): ``index``
    is ``None`` for the whole stack, else the rows gathered."""

    index: torch.Tensor | None
    params: Tensors
    buffers: Tensors
    settings: Tensors


class MemberStack:
    """Stacked parameters and buffers of up to ``capacity`` members, plus each
    member's module skeleton (on the ``meta`` device: no second copy of weights).

    ``settings`` holds each member's lifted settings (dropout rates, ...:
    chorus_tune/configuration.py) as ``(capacity,)`` tensors, which the
    template's lifted modules read on the vmap routes. They are not member
    state: a member's come from its own module (its config), every time it is
    put in.

    Members of other widths (chorus_tune/widths.py): the stack's tensors have
    the template's (widest) shapes, and a narrower member fills the leading
    corner of each (``own[slot]`` holds its own shapes). ``pad`` holds, for
    every tensor some member is narrower in, a ``(capacity, ...)`` mask of the
    entries its member does not have: :meth:`mask_gradients` zeroes their
    gradients before an update and :meth:`zero_padding` their values after
    it, so they stay exactly zero. The eager route runs each member's own
    skeleton on its own corner; the vmap routes run the template on the whole.

    :meth:`call` runs a function of each member's output through one of the
    routes: ``"vmap"`` (one vmap'd call through the template skeleton),
    ``"compiled"`` (the same call under ``torch.compile``) or ``"eager"``
    (each member through its own skeleton, in a loop). Whether the routes
    agree for a given model is the route probe's question (docs/design.md D8).
    """

    def __init__(self, template: nn.Module, capacity: int, device: torch.device,
                 compiled: CompiledCalls | None = None):
        params, buffers = module_tensors(template)
        self.capacity, self.device = capacity, device
        self.params: Tensors = {
            n: torch.zeros((capacity, *p.shape), dtype=p.dtype, device=device, requires_grad=p.requires_grad)
            for n, p in params.items()
        }
        self.buffers: Tensors = {
            n: torch.zeros((capacity, *b.shape), dtype=b.dtype, device=device) for n, b in buffers.items()
        }
        self.skeletons: list[nn.Module | None] = [None] * capacity
        self.own: list[dict[str, Shape] | None] = [None] * capacity  # each member's own shapes
        self.pad: Tensors = {}
        # The vmap routes run every member through this one skeleton. One fixed
        # module (not the first live member's) so that a compiled call's guards
        # on it hold across membership changes; its lifted modules read each
        # member's settings from ``settings``. A member whose own skeleton
        # behaves differently in a way no configuration shows is what the
        # route probe catches.
        self.template = lift(copy.deepcopy(template)).to("meta")
        self._batched: BatchedEligibility | None = None  # the batched route's verdict on the template, once asked
        self.settings: Tensors = {
            n: torch.zeros(capacity, device=device) for n in lifted_settings(template)
        }
        self.compiled = compiled if compiled is not None else CompiledCalls()

    # ----- members in and out -------------------------------------------------------------------
    @property
    def shapes(self) -> dict[str, Shape]:
        """The stack's (padded) shape of every parameter and buffer, per member."""
        return {n: tuple(t.shape[1:]) for n, t in (*self.params.items(), *self.buffers.items())}

    def put(self, slot: int, module: nn.Module) -> None:
        """Put ``module``'s tensors (its own shapes, at most the stack's) into ``slot``."""
        self.put_tensors(slot, module)
        with torch.no_grad():
            for n, value in lifted_settings(module).items():
                self.settings[n][slot] = value
        self.skeletons[slot] = copy.deepcopy(module).to("meta")
        self.own[slot] = module_shapes(module)
        self._update_masks()

    def put_tensors(self, slot: int, module: nn.Module) -> None:
        """Put ``module``'s parameters and buffers into ``slot``, whose member
        it is already (the same structure, widths and settings: a lone member
        written back after training unfused; no skeleton rebuilt)."""
        params, buffers = module_tensors(module)
        with torch.no_grad():
            for n, p in params.items():
                pad_into(self.params[n][slot], p)
            for n, b in buffers.items():
                # Padded BatchNorm statistics are zeros too (running_var included): a
                # padded channel that sees zeros keeps them, and the member's own are its own.
                pad_into(self.buffers[n][slot], b)

    def own_row(self, name: str, slot: int) -> torch.Tensor:
        """``slot``'s row of tensor ``name`` at the member's own shape (a view)."""
        source = self.params[name] if name in self.params else self.buffers[name]
        row = source[slot]
        own = self.own[slot]
        return row if own is None or tuple(row.shape) == own[name] else row[corner(own[name])]

    def load_into(self, slot: int, module: nn.Module) -> nn.Module:
        """Copy ``slot``'s tensors into ``module`` (the member's structure, at its
        own widths), return it."""
        params, buffers = module_tensors(module)
        with torch.no_grad():
            for n, t in (*params.items(), *buffers.items()):
                t.copy_(self.own_row(n, slot))
        return module

    def clear(self, slot: int) -> None:
        self.skeletons[slot] = None
        if self.own[slot] is not None:
            self.own[slot] = None
            self._update_masks()  # a frozen slot needs no mask: its padded entries are zero and stay so

    # ----- padding (chorus_tune/widths.py) ---------------------------------------------------------
    @property
    def padded(self) -> bool:
        """Whether some member here is narrower than the stack in some tensor."""
        return bool(self.pad)

    def _update_masks(self) -> None:
        """``pad`` from each member's own shapes: a mask for every tensor some
        member is narrower in (a slot with no member masks nothing: it is frozen)."""
        shapes = self.shapes
        narrow = {n for own in self.own if own is not None for n, s in own.items() if s != shapes[n]}
        pad = {}
        for n in sorted(narrow):
            mask = torch.zeros((self.capacity, *shapes[n]), dtype=torch.bool, device=self.device)
            for k, own in enumerate(self.own):
                if own is not None and own[n] != shapes[n]:
                    mask[k] = pad_mask(shapes[n], own[n], self.device)
            pad[n] = mask
        self.pad = pad

    def mask_gradients(self) -> None:
        """Zero the gradient of every padded entry. Needed, not cosmetic: a padded
        unit's value can be nonzero (``sigmoid(0)``), and the next layer's padded
        columns then get a gradient; it would also count in a member's clipping norm."""
        for n, mask in self.pad.items():
            p = self.params.get(n)
            if p is not None and p.grad is not None:
                p.grad.masked_fill_(mask, 0)

    @torch.no_grad()
    def zero_padding(self) -> None:
        """Zero every padded entry of the parameters and buffers (after an update,
        and after a forward that moved BatchNorm statistics): they stay exactly
        zero whatever the update's arithmetic (weight decay, momentum, Adam)."""
        for n, mask in self.pad.items():
            (self.params[n] if n in self.params else self.buffers[n]).masked_fill_(mask, 0)

    def grow(self, template: nn.Module) -> None:
        """Widen the stack to ``template``'s shapes (each at least the stack's):
        every member keeps its tensors in the leading corner, zeros around them.
        The vmap routes' template becomes ``template``; compiled graphs (of the
        old shapes) are dropped."""
        params, buffers = module_tensors(template)
        with torch.no_grad():
            for store, wide in ((self.params, params), (self.buffers, buffers)):
                for n, t in wide.items():
                    old = store[n]
                    if tuple(old.shape[1:]) == tuple(t.shape):
                        continue
                    new = torch.zeros((self.capacity, *t.shape), dtype=old.dtype, device=self.device)
                    new[(slice(None), *corner(tuple(old.shape[1:])))] = old.detach()
                    store[n] = new.requires_grad_(old.requires_grad)
        self.template = lift(copy.deepcopy(template)).to("meta")
        self._batched = None
        self.compiled = CompiledCalls(self.compiled.max_member_counts)
        self._update_masks()

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (compaction), renumbered from 0."""
        index = torch.tensor(rows, device=self.device)
        with torch.no_grad():
            self.params = {
                n: p[index].detach().clone().requires_grad_(p.requires_grad) for n, p in self.params.items()
            }
            self.buffers = {n: b[index].clone() for n, b in self.buffers.items()}
            self.settings = {n: s[index].clone() for n, s in self.settings.items()}
            self.pad = {n: m[index].clone() for n, m in self.pad.items()}
        self.skeletons = [self.skeletons[r] for r in rows]
        self.own = [self.own[r] for r in rows]
        self.capacity = len(rows)

    def gathered(self, rows: list[int]) -> "MemberStack":
        """A stack of copies of ``rows`` only (row ``i`` is ``rows[i]``), sharing
        this one's template and compiled calls: one iteration of a few live
        members trains on it and costs what a bucket of ``len(rows)`` costs
        (docs/design.md D5, D8). This stack is not touched; :meth:`put_back`
        copies the trained rows home."""
        view = copy.copy(self)
        view.select(rows)  # select rebinds every per-row attribute of the copy, never this stack's
        return view

    def put_back(self, rows: list[int], view: "MemberStack") -> None:
        """Copy every parameter and buffer of ``view`` (from :meth:`gathered`
        with ``rows``) back into ``rows`` of this stack."""
        index = torch.tensor(rows, device=self.device)
        with torch.no_grad():
            for n, p in self.params.items():
                p.index_copy_(0, index, view.params[n].detach())
            for n, b in self.buffers.items():
                b.index_copy_(0, index, view.buffers[n])
        for p in self.params.values():
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.buffers.values()]

    def snapshot(self, rows: list[int] | None = None, to_host: bool = False) -> RowCopies:
        """Copies of every parameter and buffer (of ``rows`` only, if given), for
        :meth:`restore`. ``to_host``: see :func:`chorus_tune.rows.copy_rows`."""
        return copy_rows(self.state_tensors(), rows, to_host)

    def restore(self, snapshot: RowCopies) -> None:
        """Put back what :meth:`snapshot` copied; gradients are dropped (they
        belonged to the step being undone)."""
        put_rows(self.state_tensors(), snapshot)
        for p in self.params.values():
            p.grad = None

    def snapshot_buffers(self, rows: list[int]) -> RowCopies:
        """Copies of ``rows`` of the buffers only (BatchNorm statistics, which
        a full-stack forward writes in every row), for :meth:`restore_buffers`."""
        return copy_rows(list(self.buffers.values()), rows)

    def restore_buffers(self, snapshot: RowCopies) -> None:
        put_rows(list(self.buffers.values()), snapshot)

    # ----- modes --------------------------------------------------------------------------------
    def _live_skeletons(self) -> Iterable[nn.Module]:
        yield self.template
        yield from (s for s in self.skeletons if s is not None)

    def set_training(self, training: bool) -> None:
        for skeleton in self._live_skeletons():
            skeleton.train(training)

    def member_settings(self, slot: int) -> dict[str, float]:
        """The lifted settings the fused routes give ``slot``."""
        return {n: float(s[slot]) for n, s in self.settings.items()}

    # ----- the routes ---------------------------------------------------------------------------
    def call(self, route: str, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool,
             slots: list[int], gather: bool = False) -> torch.Tensor:
        """``fn(output, target)`` of ``slots`` as a ``(capacity, ...)`` tensor.

        ``x``/``y`` are one batch for every member (``shared``) or one per row.
        The eager route computes ``slots`` only (zeros elsewhere). A vmap route
        computes every row of the stack unless ``gather``: then only ``slots``'
        rows, gathered (``x``/``y`` then hold those rows only, unless
        ``shared``), so a group needs memory for itself, not for the stack.
        """
        if route == "eager":
            return self.eager_call(fn, x, y, shared, slots)
        if route == "batched":
            return self.batched_call(fn, x, y, shared, slots if gather else None)
        if route not in ("vmap", "compiled"):
            raise ValueError(f"route must be 'vmap', 'compiled', 'batched' or 'eager'; got {route!r}")
        return self.vmap_call(fn, x, y, shared, slots if gather else None, compiled=route == "compiled")

    def vmap_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool,
                  rows: list[int] | None = None, compiled: bool = False) -> torch.Tensor:
        """``fn(output, target)`` of every row at once (or of ``rows`` only,
        zeros elsewhere), through the template skeleton."""
        index, params, buffers, settings = self._rows_in(rows)
        # The lifted modules' buffers take each member's settings like any buffer.
        inputs = {**buffers, **settings}
        if compiled:
            out = self.compiled.call(self._vmapped, fn, shared, params, inputs, x, y)
        else:
            out = self._vmapped(fn, shared)(params, inputs, x, y)
        if index is not None:
            with torch.no_grad():  # train-mode BatchNorm updated the gathered copies
                for n, b in buffers.items():
                    self.buffers[n].index_copy_(0, index, b)
        return self._rows_out(out, index)

    def _rows_in(self, rows: list[int] | None) -> "_RowsIn":
        """What a fused call reads: the stack's own tensors, or copies of
        ``rows`` only (gradients flow back to the stack's parameters)."""
        if rows is None:
            return _RowsIn(None, self.params, self.buffers, self.settings)
        index = torch.tensor(rows, device=self.device)
        return _RowsIn(index, *({n: t.index_select(0, index) for n, t in store.items()}
                                for store in (self.params, self.buffers, self.settings)))

    def _rows_out(self, out: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """A fused call's ``out`` as a ``(capacity, ...)`` tensor: zeros in the rows it did not read."""
        return out if index is None else out.new_zeros((self.capacity, *out.shape[1:])).index_copy(0, index, out)

    @property
    def batched(self) -> BatchedEligibility:
        """Whether the template may run on the batched route, and why not
        (chorus_tune/batched.py): traced once per template."""
        if self._batched is None:
            self._batched = batched_forward(self.template)
        return self._batched

    def batched_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool,
                     rows: list[int] | None = None) -> torch.Tensor:
        """``fn(output, target)`` of every row (or of ``rows`` only, zeros
        elsewhere), the forward run on the stack as batched tensor ops and only
        ``fn`` under vmap (chorus_tune/batched.py)."""
        forward = self.batched.forward
        if forward is None:
            raise ValueError(f"the batched route cannot run this model: {self.batched.why}")
        index, params, _, settings = self._rows_in(rows)  # no buffer: batched.py accepts no forward that reads one
        count = self.capacity if rows is None else len(rows)
        if shared:
            x = x.expand(count, *x.shape)
        if getattr(fn, "stacked", False):  # losses.stacked_mean_loss: every member's at once
            out = fn(forward(params, x, settings), y.expand(count, *y.shape) if shared else y)
        else:
            out = torch.vmap(fn, in_dims=(0, None if shared else 0))(forward(params, x, settings), y)
        return self._rows_out(out, index)

    def _vmapped(self, fn: Callable, shared: bool) -> Callable:
        skeleton = self.template

        def member(params: Tensors, buffers: Tensors, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return fn(functional_call(skeleton, (params, buffers), (xb,)), yb)

        data_dim = None if shared else 0
        return torch.vmap(member, in_dims=(0, 0, data_dim, data_dim), randomness="different")

    def eager_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool,
                   slots: list[int]) -> torch.Tensor:
        """``fn(output, target)`` per slot, each through its own module; rows of
        slots not listed are zeros."""
        results = {}
        for k in slots:
            # Each member's own corner of the padded tensors: its own model, at its own widths.
            params = {n: self.own_row(n, k) for n in self.params}
            buffers = {n: self.own_row(n, k) for n in self.buffers}
            xb, yb = (x, y) if shared else (x[k], y[k])
            results[k] = fn(functional_call(self.skeletons[k], (params, buffers), (xb,)), yb)
        template = next(iter(results.values()))
        return torch.stack([results.get(k, torch.zeros_like(template)) for k in range(self.capacity)])


def mean_loss(loss_fn: LossFn) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A member's training objective: the mean of its per-sample losses."""
    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target).mean()
    return fn
