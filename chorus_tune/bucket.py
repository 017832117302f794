"""A bucket: up to ``capacity`` members of one structure, trained fused."""
from __future__ import annotations

import copy
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import losses
from .configuration import deterministic_dropout
from .data import BatchOrder, SharedBatches, eval_batches, first_batch
from .member_spec import MemberSpec
from .member_state import check_member_state, check_state_fits
from .memory import describe_memory, is_out_of_memory, release_memory
from .optim import OptimizerSnapshot, StackedOptimizer, scheduled_lr
from .padding import padding_disagreement
from .precision import autocast
from .route import PROBE_TOLERANCE, ROUTES, ProbeResult, RouteChoice, RouteReason, decide
from .rows import RowCopies
from .seeds import chosen_seed
from .stack import MemberStack, StructuralKey, describe_split, mean_loss, module_key, module_tensors
from .task import Task, TensorSplit
from .task_metrics import MetricError, compute_metric
from .width_rule import DEFAULT_RULE, WidthRule
from .widths import Cost, Profile, padding_family, shapes_of, widen, widest

__all__ = ["Bucket", "MemberFailure", "MemberMetricError", "MemberOutOfMemory", "ROUTES", "RouteReason",
           "STATE_FORMAT"]

STATE_FORMAT = 1
# The routes that run the whole stack in one call (MemberStack.call).
_STACK_ROUTES = ("vmap", "compiled")


class MemberFailure(RuntimeError):
    """Members that failed in :meth:`Bucket.run_iteration` while the others
    completed it: raised once they have, with their metrics in ``results``
    (``{slot: metrics}``). ``slots`` are the failed members' slots, ``errors``
    ``{slot: message}`` says why each failed; the caller fails just those
    members (retires them) and keeps the rest. Both kinds below at once (rare)
    raise this base class with both kinds of errors.
    """

    def __init__(self, message: str, slots: tuple[int, ...], results: dict[int, dict[str, Any]],
                 errors: dict[int, str] | None = None):
        super().__init__(message)
        self.slots = tuple(slots)
        self.slot = self.slots[0]
        self.results = results
        self.errors = dict(errors) if errors is not None else {k: message for k in self.slots}

    def __reduce__(self):  # an actor's exception crosses processes pickled
        return type(self), (str(self), self.slots, self.results, self.errors)


class MemberMetricError(MemberFailure):
    """A task metric (``Task(metrics=...)``) raised, or returned no number, on
    the evaluation of the members in ``slots``; ``errors[slot]`` is the
    metric's own message, naming it and the member. Those members trained this
    iteration (their state has advanced); their results are not in
    ``results``: retire them."""


class MemberOutOfMemory(MemberFailure):
    """Members that ran out of memory in :meth:`Bucket.run_iteration` even
    trained one at a time.

    Raised only once the iteration's other members have completed: their
    metrics are in ``results`` (``{slot: metrics}``; with ``slots`` it covers
    every slot the iteration was asked for, each once). Each failed member is
    left in its slot exactly as it was when the iteration started (parameters,
    buffers, optimizer state, batch order, counters), so the caller fails just
    that member by retiring it, or moves it with ``member_state`` to a bucket
    with more room, and keeps the rest. ``slot`` is the first of ``slots``.
    """


@dataclass
class _Snapshot:
    stack: RowCopies
    optimizer: OptimizerSnapshot


@dataclass
class _IterationPlan:
    """One iteration's inputs, drawn once: every attempt at it (the fused one,
    then smaller groups after an out-of-memory error) trains each member on the
    same batches and learning rates it would have had."""

    live: list[int]
    steps: int
    lr: torch.Tensor  # (steps, capacity)
    index: torch.Tensor | None  # (steps, capacity, batch) rows of the tensor data, or None: shared batches
    orders: dict[int, dict]  # each member's batch order at the start, for members that end up not training
    # Shared-batch mode: the iteration's batches, kept (host memory, one
    # iteration's worth) so that a group retried after an error sees the same ones.
    tape: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (capacity,) label smoothing of each member, or None when no member of the plan smooths.
    smoothing: torch.Tensor | None = None
    # {slot: message}: members whose metric failed in a completed group (a group retried
    # after running out of memory adds its members' only once it completes).
    metric_errors: dict[int, str] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)  # members whose group completed

    def for_rows(self, rows: list[int]) -> "_IterationPlan":
        """This plan for a stack gathered from ``rows`` (its row ``i`` is
        ``rows[i]``): the same batches and learning rates, renumbered."""
        return _IterationPlan(list(range(len(rows))), self.steps, self.lr[:, rows],
                     None if self.index is None else self.index[:, rows], {}, self.tape,
                     None if self.smoothing is None else self.smoothing[rows])


@dataclass
class Member:
    config: dict
    seed: int
    family: str
    hp: dict[str, Any]
    iteration: int
    step: int
    order: BatchOrder | None
    label_smoothing: float = 0.0


class Bucket:
    """Up to ``capacity`` members that share a structural key, trained as one.

    Members come in with :meth:`add` (new) or :meth:`restore` (from a
    :meth:`member_state`), are trained one iteration at a time by
    :meth:`run_iteration` (every live member, or a chosen subset, fused), and
    leave with :meth:`retire`. A retired or empty slot is masked, never
    reshaped: its parameters, buffers and optimizer state stay bit-for-bit
    frozen. :meth:`compact` drops empty slots between iterations.

    ``route`` is ``"auto"`` (probe the fused routes against an eager loop on
    a probe batch, keep the fastest that agrees: docs/design.md D8 and
    ``chorus_tune/route.py``), ``"vmap"``, ``"compiled"`` or ``"eager"``.
    :meth:`route_report` says which runs and why.

    Out of memory (docs/design.md D13): an iteration that runs out is put back and
    finished in smaller groups (see :meth:`run_iteration`). ``max_group`` is the
    group size that then worked (``None``: never ran out), used directly by
    later iterations; set it back to ``None`` to try every member at once
    again. ``oom_recoveries`` counts the out-of-memory errors survived.

    Widths (docs/design.md D9, chorus_tune/widths.py): members whose models
    differ only in the widths of Linear, Conv, BatchNorm and Embedding layers
    share the bucket padded to the widest, each training exactly as its own
    model, while ``width_rule`` (chorus_tune/width_rule.py) says the padding
    costs each member at most its factor (priced by multiply-adds per sample,
    on this bucket's device); ``width_rule=None``: members of one width only. A member whose padded
    forward or gradient disagrees with its own model's (the padding check,
    chorus_tune/padding.py) is refused (``padding_mismatch="refuse"``), or
    taken and the bucket runs every member on the eager route, each its own
    model (``"eager"``: for a caller that cannot place it elsewhere; only
    under ``route="auto"``). ``key`` is what every member shares (the padded
    family: ``widths.padding_family``).
    """

    def __init__(self, task: Task, capacity: int, device: str | torch.device = "cpu", route: str = "auto",
                 width_rule: WidthRule | None = DEFAULT_RULE, padding_mismatch: str = "refuse"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer (the number of slots); got {capacity!r}")
        if width_rule is not None and not isinstance(width_rule, WidthRule):
            raise TypeError(f"width_rule must be a WidthRule or None; got {type(width_rule).__name__}")
        self.routing = RouteChoice(route)  # a ValueError for an unknown route
        self.task, self.capacity, self.device = task, capacity, torch.device(device)
        if padding_mismatch not in ("refuse", "eager"):
            raise ValueError(f"padding_mismatch must be 'refuse' or 'eager'; got {padding_mismatch!r}")
        self.width_rule, self.padding_mismatch = width_rule, padding_mismatch
        self._profile: Profile | None = None  # where the model computes, for pricing padding
        self.key: StructuralKey | None = None
        self.model_name: str | None = None
        self.members: list[Member | None] = [None] * capacity
        self.stack: MemberStack | None = None
        self.optimizer: StackedOptimizer | None = None
        self._train = self._val = None
        self._shared: SharedBatches | None = None
        self._loss = task.loss_fn
        # One object each, for the life of the bucket: the compiled route
        # keeps one graph per function it is handed. The vmapped routes take
        # the loss's vmap form (the same values; losses.vmap_form says why).
        self._eager_fns = _Objectives.of(self._loss, task.is_classification)
        self._vmap_fns = _Objectives.of(losses.vmap_form(self._loss), task.is_classification)
        self.fused_steps = 0
        # Rows the last iteration computed (a masked row of a full-stack call
        # counts: it costs as much as a live one); its members trained are
        # fewer where rows ran masked.
        self.last_rows = 0
        self._last_routes: set[str] = set()  # the routes the last iteration's groups took
        self.max_group: int | None = None
        self.oom_recoveries = 0

    # ----- which route, and why (docs/design.md D8) ------------------------------------------------
    @property
    def requested_route(self) -> str:
        return self.routing.requested

    @property
    def route(self) -> str | None:
        """The route the fused step takes: ``"vmap"``, ``"compiled"``,
        ``"eager"``, or ``None`` before the first probe."""
        return self.routing.route

    @property
    def route_reason(self) -> RouteReason:
        return self.routing.reason

    def route_report(self) -> dict[str, Any]:
        """The route, why (``reason``: a :class:`RouteReason` value, and its
        ``description``), the probe's best step time per route (``seconds``),
        the candidates it rejected and why, the members left out of the
        comparison as non-finite, and the compiled route's compilations.

        And the structure the bucket was opened for (docs/design.md D9):
        ``per_member`` holds each lifted setting's value per live slot (what
        the fused routes give each member, e.g. ``{"2.p": {0: 0.3, 1: 0.9}}``),
        ``configuration`` the settings every member here shares, one line per
        submodule that has any (a member differing in one of them is refused:
        it needs a bucket of its own)."""
        report = self.routing.report()
        if self.stack is not None:
            report["compiles"] = self.stack.compiled.compiles
            report["uncompiled_calls"] = self.stack.compiled.uncompiled_calls
            report["per_member"] = {n: {k: float(f"{float(s[k]):.6g}") for k in self.live_slots}  # float32 noise off
                                    for n, s in self.stack.settings.items()}
            report["configuration"] = self.describe_configuration()
            report["padding"] = self.padding_report()
        return report

    def describe_configuration(self) -> list[str]:
        """The module settings every member of this bucket shares (its key's
        configuration), one line per submodule with any, and the lifted ones
        named as per member. Empty before the first member."""
        if self.key is None:
            return []
        lines = []
        lifted = set(self.stack.settings)
        for path, kind, settings in self.key.configuration:
            own = [f"{n}={v}" for n, v in settings if n != "extra_repr"]
            own += [f"{n.rpartition('.')[2]}=per member" for n in sorted(lifted) if n.rpartition(".")[0] == path]
            lines.append(f"{path or '(root)'}: {kind.rsplit('.', 1)[-1]}" + (f"({', '.join(own)})" if own else ""))
        return lines

    # ----- who is here ----------------------------------------------------------------------------
    @property
    def live_slots(self) -> list[int]:
        return [k for k, m in enumerate(self.members) if m is not None]

    @property
    def free_slots(self) -> list[int]:
        return [k for k, m in enumerate(self.members) if m is None]

    def config(self, slot: int) -> dict:
        return self._member(slot).config

    def seed(self, slot: int) -> int:
        return self._member(slot).seed

    def iteration(self, slot: int) -> int:
        return self._member(slot).iteration

    def _member(self, slot: int) -> Member:
        member = self.members[slot] if 0 <= slot < self.capacity else None
        if member is None:
            raise KeyError(f"slot {slot} holds no member")
        return member

    def __repr__(self) -> str:
        return f"Bucket({self.model_name or '?'}, {len(self.live_slots)}/{self.capacity} live, route={self.route})"

    # ----- members in -----------------------------------------------------------------------------
    def add(self, config: dict, seed: int | None = None) -> int:
        """Take a new member into a free slot; returns the slot.

        The seed is ``seed``, else the config's ``"seed"``, else a fresh one
        (reported in every result). Raises whatever the model factory raises,
        ``ValueError`` for a config of another structure or a full bucket; the
        bucket is unchanged then.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict; got {type(config).__name__} "
                            "(a saved member goes in with Bucket.restore(state))")
        config = dict(config)
        return self._take(config, chosen_seed(config, seed, otherwise=lambda: secrets.randbelow(2**31)), None)

    def restore(self, state: dict[str, Any], config: dict | None = None) -> int:
        """Take a member saved by :meth:`member_state` (from any bucket of
        this structure) into a free slot; returns the slot. It continues
        exactly where it was saved.

        ``config`` replaces the saved config (PBT: a cloned state under a
        mutated config); the seed, weights, optimizer state, data order and
        counters are the state's. Raises ``ValueError`` naming what a state
        lacks, and as :meth:`add` does otherwise.
        """
        check_member_state(state)
        config = dict(state["config"] if config is None else config)
        return self._take(config, int(state["seed"]), state)

    def _take(self, config: dict, seed: int, state: dict | None) -> int:
        # Everything that can fail runs before anything changes.
        free = self.free_slots
        if not free:
            raise ValueError(f"bucket is full ({self.capacity} members)")
        spec = MemberSpec.read(self.task, config, seed)
        module = self.task.build_model(config, seed)  # the factory's own error propagates
        if state is not None:
            check_state_fits(state, spec.family, module)
            module.load_state_dict(state["model"])
        key = module_key(self.task, config, module)  # the model is built already: no second build
        if self.key is not None and padding_family(key) != self.key:
            raise ValueError(
                f"config {config} does not share this bucket's structure ({self.model_name}): "
                f"{describe_split(self.key, key)}"
            )
        template = None
        if self.stack is None:  # the data, model and capacity, checked before the bucket takes memory
            self.task.check_model(module)
            self.task.check_capacity(self.capacity, module, config, self.device)
        elif shapes_of(key) != self.stack.shapes:
            template = self._admit_widths(module, key, config)  # a ValueError if its widths may not pad here
        if self.stack is None:
            self._materialise(module, key, config)
        elif template is not None:
            self._grow(template)
        slot = free[0]
        order = None
        if isinstance(self._train, TensorSplit):
            order = BatchOrder(len(self._train), spec.batch_size, seed)
            if state is not None and state.get("data") is not None:
                order.load_state_dict(state["data"])
        self.stack.put(slot, module.to(self.device))
        self.optimizer.set_member(slot, spec.hp, None if state is None else state["optimizer"])
        self.members[slot] = Member(
            config=config, seed=seed, family=spec.family, hp=spec.hp,
            iteration=0 if state is None else int(state["iteration"]),
            step=0 if state is None else int(state["step"]),
            order=order, label_smoothing=spec.label_smoothing,
        )
        self.routing.member_joined()
        return slot

    def _materialise(self, template: nn.Module, key: StructuralKey, config: dict) -> None:
        self.key, self.model_name = padding_family(key), type(template).__name__
        train, val = self.task.load_data()
        self._train = train.to(self.device) if isinstance(train, TensorSplit) else train
        self._val = val.to(self.device) if isinstance(val, TensorSplit) else val
        if not isinstance(train, TensorSplit):
            self._shared = SharedBatches(train, self.task.batch_size_for(config), self.task.data_seed)
        # Profiled now, while nothing trains: the profile copies the template,
        # and a training step swaps batched tensors into it (functional_call
        # under vmap), so a copy taken later, when a bucket actor's describe()
        # runs beside an iteration, failed ("Cannot access storage of
        # BatchedTensorImpl": seen in a clean CI run, test_cluster's stats).
        # Where the model computes per sample does not change as widths grow.
        # Taken before self.stack is set: describe() reads the stack, then the profile.
        self._profile = Profile.of(template, first_batch(self._train, 1)[0][0])
        self.stack = MemberStack(template, self.capacity, self.device)
        self._batch_size = self.task.batch_size_for(config)
        by_identity = {id(t): n for n, t in (*template.named_parameters(), *template.named_buffers())}
        entries = template.state_dict(keep_vars=True)
        # None: the state_dict holds more than tensors of the stack (extra state):
        # then a member's state goes through a real model build.
        self._state_names = ({key: by_identity[id(t)] for key, t in entries.items()}
                             if all(id(t) in by_identity for t in entries.values()) else None)
        self.optimizer = StackedOptimizer(key.optimizer, self.stack.params)

    # ----- widths (docs/design.md D9; chorus_tune/widths.py) ------------------------------------------
    def _admit_widths(self, module: nn.Module, key: StructuralKey, config: dict) -> nn.Module | None:
        """Check that a member of other widths may join (the sharing rule, and
        the padding check for it and, if the stack must widen, for every member
        here); the widened template if the stack must grow, else ``None``.
        Raises ``ValueError`` saying why not; nothing has changed then."""
        where = f"config {config} cannot share this bucket ({self.model_name})"
        if self.width_rule is None:
            raise ValueError(f"{where}: its widths differ and this bucket does not pad (width_rule=None)")
        own = shapes_of(key)
        shapes = widest([self.stack.shapes, own])
        growing = shapes != self.stack.shapes
        live = self.live_slots
        costs = [self._cost(self.stack.own[k]).measure for k in live] + [self._cost(own).measure]
        verdict = self.width_rule.judge(costs, self._cost(shapes).measure, self.device.type, self._batch_size)
        if not verdict.shares:
            raise ValueError(f"{where}: {verdict.reason} (chorus_tune/width_rule.py)")
        if growing:
            self.task.check_capacity(self.capacity, widen(module, shapes), config, self.device)
        x, y = self._padding_batch()
        params, buffers = module_tensors(module)
        problem = self._padding_problem(module, params, buffers, shapes, x, y)
        if problem is not None:
            problem = f"padded to its widths, {problem}"
        elif growing:
            for k in live:  # every member here is padded anew: each checked against the wider template
                own_params = {n: self.stack.own_row(n, k) for n in self.stack.params}
                own_buffers = {n: self.stack.own_row(n, k) for n in self.stack.buffers}
                problem = self._padding_problem(self.stack.skeletons[k], own_params, own_buffers, shapes, x, y)
                if problem is not None:
                    problem = f"widening the bucket to its widths would change the member in slot {k}: {problem}"
                    break
        if problem is not None:
            if self.padding_mismatch == "refuse" or self.routing.requested in _STACK_ROUTES:
                raise ValueError(f"{where}: {problem}; it needs a bucket of its own widths")
            # Taken: the eager route runs each member's own model at its own widths, always correct.
            if self.routing.requested == "auto":
                self.routing.reject("vmap", "padding", problem)
                self.routing.settle("eager", RouteReason.PADDING_DISAGREES)
        return widen(module, shapes) if growing else None

    def _padding_problem(self, own: nn.Module, params, buffers, shapes, x, y) -> str | None:
        return padding_disagreement(own, params, buffers, shapes, x, y, self._loss, self.task.precision,
                                    self.device, PROBE_TOLERANCE[self.task.precision])

    def _padding_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = first_batch(self._train, self._batch_size)
        return x.to(self.device), y.to(self.device)

    def _grow(self, template: nn.Module) -> None:
        """Widen the stack and the optimizer state to ``template``'s shapes; the
        routes are probed (and timed) again: the step costs more now."""
        self.stack.grow(template)
        self.optimizer.grow()
        self.routing.seconds = {}

    def _cost(self, shapes: dict) -> Cost:
        return self._profile.cost(shapes, self.stack.params)

    def padding_report(self) -> dict[int, dict[str, Any]]:
        """What each live member pays for its padding: its own and the padded
        parameter counts and estimated multiply-adds per sample (``None``: the
        model's forward could not be profiled), and ``factor``, padded over own
        (multiply-adds where known, else parameters). Empty before the first member."""
        if self.stack is None:
            return {}
        padded = self._cost(self.stack.shapes)
        out = {}
        for k in self.live_slots:
            own = self._cost(self.stack.own[k])
            out[k] = {"own_params": own.params, "padded_params": padded.params, "own_macs": own.macs,
                      "padded_macs": padded.macs, "factor": float(f"{padded.measure / own.measure:.4g}")}
        return out

    def describe_padding(self, slot: int) -> str:
        """What the member in ``slot`` pays for its padding, in words."""
        row = self.padding_report()[slot]
        if row["factor"] == 1:
            return f"slot {slot} runs at its own widths"
        what = "multiply-adds per sample" if row["own_macs"] is not None else "parameters"
        own, padded = ((row["own_macs"], row["padded_macs"]) if row["own_macs"] is not None
                       else (row["own_params"], row["padded_params"]))
        return (f"slot {slot} runs padded: {padded:.4g} {what} for its own {own:.4g} ({row['factor']:.3g}x; "
                f"parameters {row['padded_params']} for its own {row['own_params']})")

    # ----- members out ----------------------------------------------------------------------------
    def retire(self, slot: int) -> None:
        """Free ``slot``; its tensors stay frozen until another member takes it. Idempotent."""
        if 0 <= slot < self.capacity and self.members[slot] is not None:
            self.members[slot] = None
            self.stack.clear(slot)

    def member_state(self, slot: int) -> dict[str, Any]:
        """Everything that makes this member itself, portable to any slot of
        any bucket of the same structure (docs/design.md D7)."""
        member = self._member(slot)
        return {
            "format": STATE_FORMAT,
            "config": dict(member.config),
            "seed": member.seed,
            "model": (self._state_dict_rows(slot) if self._state_names is not None
                      else self.export_model(slot).state_dict()),
            "optimizer": self.optimizer.member_state(slot, self.stack.own[slot]),
            "iteration": member.iteration,
            "step": member.step,
            "data": None if member.order is None else member.order.state_dict(),
        }

    def _state_dict_rows(self, slot: int) -> dict[str, torch.Tensor]:
        # The member's state_dict in the user's key names, read straight off the
        # stack (no model build: the bucket snapshots members every iteration).
        # Tied parameters appear under each of their names, as in state_dict.
        rows = {}
        for key, name in self._state_names.items():
            # At the member's own widths (its corner of a padded stack).
            rows[key] = self.stack.own_row(name, slot).detach().to("cpu", copy=True)
        return rows

    def export_model(self, slot: int) -> nn.Module:
        """The member as an instance of the user's own class, on the CPU, in eval mode."""
        member = self._member(slot)
        module = self.task.build_model(member.config, member.seed)
        return self.stack.load_into(slot, module).eval()

    def compact(self) -> dict[int, int]:
        """Drop the empty slots: capacity shrinks to the live members. Returns
        ``{old_slot: new_slot}``."""
        live = self.live_slots
        if not live or len(live) == self.capacity:
            return {k: k for k in live}
        self.stack.select(live)
        self.optimizer.select(live, self.stack.params)
        self.members = [self.members[k] for k in live]
        self.capacity = len(live)
        return {old: new for new, old in enumerate(live)}

    # ----- training -------------------------------------------------------------------------------
    def run_iteration(self, slots: list[int] | None = None) -> dict[int, dict[str, Any]]:
        """One iteration of the members in ``slots`` (default: every live one),
        fused; ``{slot: metrics}``.

        A live member left out sits this iteration out exactly as a retired
        slot does: its parameters, buffers, optimizer state and batch order
        stay bit-for-bit as they were, so it can catch up later on its own
        trajectory (a bucket runs members ahead of their trials and masks the
        ones whose trial lags).

        Running out of memory loses nothing: the members' rows are put back to
        the iteration's start and the iteration is finished in groups of half
        the size, halving again until a group fits; each member still follows
        its own trajectory (the others in the bucket are frozen meanwhile), and
        ``max_group`` remembers the size for later iterations. A member that
        runs out even alone raises :class:`MemberOutOfMemory`, once every other
        member has completed; the completed members' metrics travel with it.

        Each member's metrics include the task's own ``metrics``, each computed
        on the member's outputs for the whole validation split. A metric that
        raises (or returns no number) on a member's evaluation fails that member
        only: :class:`MemberMetricError`, raised once the others are done, with
        their metrics and the metric's message for each failed member.
        """
        if slots is None:
            live = self.live_slots
        else:
            live = sorted(set(slots))
            for k in live:
                self._member(k)  # a KeyError for a slot that holds no member
        self.last_rows, self._last_routes = 0, set()
        if not live:
            return {}
        # Probe with every live member, not only this iteration's: a newcomer
        # that sits this one out must still be checked against vmap. Not while
        # a member is alone: it trains eager (_route_for), and a bucket whose
        # members never meet (a sweep that splits into one-member buckets)
        # pays for no probe; the second member's arrival probes.
        if len(self.live_slots) > 1 or self.routing.requested != "auto":
            self._ensure_route(self.live_slots)
        plan = self._plan(live)
        try:
            results, failed = self._train_in_groups(plan)
        except BaseException:
            # An iteration that raises leaves its members where they were: the
            # group that raised put its rows back (or never touched them), and
            # the members that did not complete get their place in the data back
            # (only an earlier group, after running out of memory, can have).
            self._rewind_orders({k: o for k, o in plan.orders.items() if k not in plan.completed})
            raise
        if failed and plan.metric_errors:
            out_of_memory = self._member_out_of_memory(plan, failed, results)
            errors = {**out_of_memory.errors, **plan.metric_errors}
            raise MemberFailure(f"{out_of_memory}; and {self._metric_failure(plan, results)}", tuple(sorted(errors)),
                                results, errors)
        if failed:
            raise self._member_out_of_memory(plan, failed, results)
        if plan.metric_errors:
            raise MemberMetricError(self._metric_failure(plan, results), tuple(sorted(plan.metric_errors)),
                                    results, plan.metric_errors)
        return results

    def _metric_failure(self, plan: _IterationPlan, results: dict[int, dict[str, Any]]) -> str:
        slots = sorted(plan.metric_errors)
        return (f"a task metric failed on the evaluation of {len(slots)} member(s) "
                f"({'; '.join(plan.metric_errors[k] for k in slots)}); {len(results)} other member(s) completed "
                "this iteration (.results)")

    def _plan(self, live: list[int]) -> _IterationPlan:
        first = self.members[live[0]]
        steps = self.task.steps_per_iteration(first.config)
        orders = {k: self.members[k].order.state_dict() for k in live if self.members[k].order is not None}
        lr = self._lr_table(live, steps)  # before the batch orders move: it may raise
        try:
            index = self._index_table(live, steps)  # advances the batch orders
        except BaseException:
            self._rewind_orders(orders)  # no member may lose its place in the data
            raise
        return _IterationPlan(live, steps, lr, index, orders, smoothing=self._smoothing(live))

    def _smoothing(self, live: list[int]) -> torch.Tensor | None:
        """Each member's label smoothing as a ``(capacity,)`` tensor, or ``None``
        when none of ``live`` smooths (the plain objective, at no extra cost)."""
        values = [self.members[k].label_smoothing if k in live else 0.0 for k in range(self.capacity)]
        if not any(values):
            return None
        return torch.tensor(values, device=self.device)

    def _rewind_orders(self, orders: dict[int, dict]) -> None:
        for k, state in orders.items():
            self.members[k].order.load_state_dict(state)

    def _train_in_groups(self, plan: _IterationPlan) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """Train ``plan.live`` in groups of at most ``max_group``; after an
        out-of-memory error, put the group back and retry it at half the size.

        Why: a fused step's memory grows with the number of members it runs,
        so running out says the group is too big, not that a member is bad.
        Each smaller group is exact (members outside it are frozen), so every
        member still makes exactly this iteration's progress. Only a member
        that runs out alone is given up on: ``(results, {slot: error})``.
        """
        size = self._group_size(len(plan.live))
        pending = list(plan.live)
        results: dict[int, dict[str, Any]] = {}
        failed: dict[int, str] = {}
        while pending:
            group = pending[:size]
            out, error = self._attempt(group, plan)
            if out is not None:
                results.update(out)
                plan.completed.update(group)
                pending = pending[len(group):]
            elif size > 1:
                size = self._limit_group(size)
            else:
                failed[group[0]] = error
                pending = pending[1:]
        return results, failed

    def _group_size(self, n: int) -> int:
        return n if self.max_group is None else min(n, self.max_group)

    def _limit_group(self, size: int) -> int:
        """Halve the group size (rounding up) and remember it for later iterations."""
        self.max_group = max(1, (size + 1) // 2)
        return self.max_group

    def _attempt(self, group: list[int], plan: _IterationPlan) -> tuple[dict[int, dict[str, Any]] | None, str | None]:
        """Train ``group`` through ``plan``: ``(metrics, None)``, or, if it ran
        out of memory, ``(None, error)`` with the group's rows put back.

        The rows are put back and the memory released only after the
        ``except`` block: inside it, the exception's traceback still holds the
        failed step's frames, and with them every activation tensor.
        """
        route = self._route_for(group)
        if self._trains_gathered(group, route):
            return self._attempt_gathered(group, plan, route)
        gather = self._gathers(group, route)
        start = None
        try:
            start = self._snapshot_state(self._rows_touched(group, gather), to_host=True)
            out = self._train_group(group, plan, gather, route)
            self._ran(route, self.capacity if route in _STACK_ROUTES and not gather else len(group))
            return out, None
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is retried
            if not is_out_of_memory(exc):
                if start is not None:  # an iteration that raises leaves every member where it was
                    self._restore_state(start)
                raise
            error = _describe_error(exc)
        if start is not None:  # else the snapshot itself ran out, before anything changed
            self._restore_state(start)
        release_memory(self.device)
        self.oom_recoveries += 1
        return None, error

    @property
    def last_route(self) -> str | None:
        """The route the last iteration took (``"eager+vmap"``: its groups
        differed), or ``None`` before the first."""
        return "+".join(sorted(self._last_routes)) or None

    def _ran(self, route: str, rows: int) -> None:
        self.last_rows += rows
        self._last_routes.add(route)

    def _route_for(self, group: list[int]) -> str:
        """The route ``group`` trains on this time: the bucket's, except that a
        lone member of an ``"auto"`` bucket takes the eager route (its own
        module, what the probe compares every route with). Why: vmap over one
        row only adds the batching around the same arithmetic; measured on the
        2-core CPU, a width-64 MLP's epoch took 0.20 s on vmap against 0.15 s
        eager. A route asked for is kept whatever the count (the tests pin it)."""
        if len(group) == 1 and self.routing.requested == "auto":
            return "eager"
        return self.route

    def _trains_gathered(self, group: list[int], route: str) -> bool:
        """Whether ``group`` trains on a stack of its own rows (gathered once
        for the iteration, put back after it) instead of the whole stack with
        the others masked. A masked row costs a fused step as much as a live
        one (measured: 2 live of 16 took 2.4x what a bucket of 2 took), so any
        group smaller than the stack is gathered; the copies cost one pass over
        its rows each way per iteration, not per step. On the compiled route
        only groups of at most half the stack: each member count compiles a
        graph of its own (chorus_tune/compiling.py), and halving keeps them
        O(log K)."""
        if len(group) == self.capacity:
            return False
        return route != "compiled" or 2 * len(group) <= self.capacity

    def _attempt_gathered(self, group: list[int], plan: _IterationPlan,
                          route: str) -> tuple[dict[int, dict[str, Any]] | None, str | None]:
        """:meth:`_attempt` for a group trained on a gathered stack of its own
        rows: the bucket's own tensors change only once the group has
        completed (the rows are put back then), so a group that fails leaves
        them as they were, with nothing to restore."""
        view = None
        try:
            view = self._gathered(group)
            rows = plan.for_rows(group)
            out = view._train_group(list(range(len(group))), rows, False, route)
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is retried
            if not is_out_of_memory(exc):
                raise
            error = _describe_error(exc)
        else:
            self.stack.put_back(group, view.stack)
            self.optimizer.put_back(group, view.optimizer)
            self.fused_steps += plan.steps
            self._ran(route, len(group))
            plan.metric_errors.update({group[i]: message for i, message in rows.metric_errors.items()})
            return {group[i]: metrics for i, metrics in out.items()}, None
        del view  # its tensors go before the memory is given back
        release_memory(self.device)
        self.oom_recoveries += 1
        return None, error

    def _gathered(self, group: list[int]) -> "Bucket":
        """This bucket as a bucket of ``group`` alone: copies of its rows of
        the stack and the optimizer, the same member records (their counters
        advance there), the same task, data and routing."""
        view = copy.copy(self)
        view.stack = self.stack.gathered(group)
        view.optimizer = self.optimizer.gathered(group, view.stack.params)
        view.members = [self.members[k] for k in group]
        view.capacity, view.max_group = len(group), None
        return view

    def _gathers(self, group: list[int], route: str | None) -> bool:
        """Whether ``group`` runs vmap'd over its own rows only. Once memory has
        run short, yes: a full-stack vmap call (``MemberStack.call`` without
        ``gather``) runs every row of the stack, masked ones included, so a
        smaller group would need as much memory."""
        return self.max_group is not None and route in _STACK_ROUTES and len(group) < self.capacity

    def _rows_touched(self, group: list[int], gather: bool) -> list[int] | None:
        """The rows training ``group`` can change (``None``: all of them): the
        group's own, except that a full-stack vmap also writes every row's
        BatchNorm statistics (put back only at the end of the group)."""
        if len(group) == self.capacity or (self.route in _STACK_ROUTES and not gather):
            return None
        return group

    def _train_group(self, group: list[int], plan: _IterationPlan, gather: bool,
                     route: str) -> dict[int, dict[str, Any]]:
        active = self._active_mask(group)
        # The full-stack forward updates BatchNorm statistics of every row,
        # empty ones too; the rows of members outside the group are put back so
        # they stay frozen. A gathered forward touches the group's rows only.
        others = [k for k in range(self.capacity) if k not in group]
        frozen = None if gather or not others else self.stack.snapshot_buffers(others)
        self.stack.set_training(True)
        loss_sum = torch.zeros(self.capacity, device=self.device)
        for s in range(plan.steps):
            x, y, shared = self._batch(plan, s, group if gather else None)
            loss_sum += self._train_step(x, y, shared, plan.lr[s], active, group, route, gather,
                                         plan.smoothing).detach()
        if frozen is not None:
            self.stack.restore_buffers(frozen)
        val, metric_errors = self._evaluate(group, gather, route)
        train_loss = (loss_sum / plan.steps).tolist()
        # Counters last: a group that fails anywhere above has not advanced.
        self.fused_steps += plan.steps
        out = {}
        plan.metric_errors.update(metric_errors)
        for k in group:
            m = self.members[k]
            m.iteration += 1
            m.step += plan.steps
            if k in metric_errors:
                continue
            out[k] = {"train_loss": train_loss[k], **{n: v[k] for n, v in val.items()},
                      "iteration": m.iteration, "route": route, "seed": m.seed}
        return out

    def _member_out_of_memory(self, plan: _IterationPlan, failed: dict[int, str],
                              results: dict[int, dict[str, Any]]) -> MemberOutOfMemory:
        # Back to where the iteration found them: they did not train.
        self._rewind_orders({k: state for k, state in plan.orders.items() if k in failed})
        slots = tuple(sorted(failed))
        names = ", ".join(f"slot {k}" for k in slots)
        message = (
            f"{names} ({self.model_name}, in a bucket of K={self.capacity}) ran out of memory even trained "
            f"alone on {self.device} ({describe_memory(self.device)}); last error: {failed[slots[0]]}. "
            f"{len(results)} other member(s) completed this iteration (.results); the failed member(s) are "
            "unchanged since the iteration's start: retire them, or move them to a bucket with more room"
        )
        return MemberOutOfMemory(message, slots, results)

    def _active_mask(self, live: list[int]) -> torch.Tensor:
        active = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        active[live] = True
        return active

    def _lr_table(self, live: list[int], steps: int) -> torch.Tensor:
        table = torch.zeros(steps, self.capacity)
        for k in live:
            m = self.members[k]
            for s in range(steps):
                table[s, k] = scheduled_lr(m.hp["lr"], m.hp["schedule"], m.step + s)
        return table.to(self.device)

    def _index_table(self, live: list[int], steps: int) -> torch.Tensor | None:
        if self._shared is not None:
            return None
        batch = self.task.batch_size_for(self.members[live[0]].config)
        table = torch.zeros(steps, self.capacity, batch, dtype=torch.long)
        for k in live:
            table[:, k] = self.members[k].order.take(steps)
        return table.to(self.device)

    def _batch(self, plan: _IterationPlan, s: int, rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Step ``s``'s batch: shared, or one per row (only ``rows``' rows, if given)."""
        if plan.index is None:
            while len(plan.tape) <= s:
                plan.tape.append(self._shared.next())
            x, y = plan.tape[s]
            return x.to(self.device), y.to(self.device), True
        x, y = self._train.tensors
        idx = plan.index[s] if rows is None else plan.index[s, rows]
        return x[idx], y[idx], False

    def _objectives(self, route: str | None) -> "_Objectives":
        return self._eager_fns if route == "eager" else self._vmap_fns

    def _fused_call(self, fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool, slots: list[int],
                    route: str | None, gather: bool) -> torch.Tensor:
        """``fn(output, target)`` of ``slots`` as a ``(capacity, ...)`` tensor
        (see ``MemberStack.call``), in the task's precision."""
        with autocast(self.task.precision, self.device):
            return self.stack.call(route, fn, x, y, shared, slots, gather)

    def _train_step(self, x, y, shared: bool, lr: torch.Tensor, active: torch.Tensor,
                    live: list[int], route: str, gather: bool = False,
                    smoothing: torch.Tensor | None = None) -> torch.Tensor:
        for p in self.stack.params.values():
            p.grad = None
        fns = self._objectives(route)
        if smoothing is None:
            member_losses = self._fused_call(fns.train, x, y, shared, live, route, gather)
        else:
            # Label smoothing per member: the fused call gives each member's
            # [cross entropy, smoothing term]; its own eps mixes them, as
            # F.cross_entropy(label_smoothing=eps) would (losses.smoothing_parts).
            # A member without smoothing takes the plain cross entropy as is.
            parts = self._fused_call(fns.smoothed, x, y, shared, live, route, gather)
            smoothed = (1 - smoothing) * parts[:, 0] + smoothing * parts[:, 1]
            member_losses = torch.where(smoothing > 0, smoothed, parts[:, 0])
        # Sum, not mean, over members: each member's gradient keeps the scale of
        # its unfused run (a mean would divide every learning rate by K).
        torch.where(active, member_losses, torch.zeros_like(member_losses)).sum().backward()
        if self.stack.padded:
            # Padded entries: no gradient in (not even into a member's clipping
            # norm), and exactly zero after the update and the forward's
            # BatchNorm statistics (chorus_tune/widths.py says why both).
            self.stack.mask_gradients()
            self.optimizer.step(lr, active, live)
            self.stack.zero_padding()
        else:
            self.optimizer.step(lr, active, live)
        return member_losses

    @torch.no_grad()
    def _evaluate(self, live: list[int], gather: bool = False,
                  route: str | None = None) -> tuple[dict[str, list[float]], dict[int, str]]:
        """Each member's validation metrics (``{name: [value per row]}``), and
        ``{slot: message}`` for the members whose task metric failed."""
        self.stack.set_training(False)
        # Evaluation is not compiled: it runs once an iteration, and compiling
        # it would add graphs (and minutes) for little.
        route = self.route if route is None else route
        route = "vmap" if route == "compiled" else route
        metrics = self.task.metrics or {}
        # With task metrics, the fused call hands back each member's outputs
        # too (flattened after its sums: one tensor, so every route stacks
        # it), kept for the whole split: a metric such as F1 or AUC is not a
        # mean of per-batch values (chorus_tune/task_metrics.py).
        stats_fn = self._objectives(route).evaluate
        fn, n_stats = (stats_fn, None) if not metrics else self._eval_with_outputs(stats_fn)
        total, count, outputs, targets = None, 0, [], []
        for x, y in eval_batches(self._val, self.task.eval_batch_size, self.device):
            batch = self._fused_call(fn, x, y, True, live, route, gather).float()
            if metrics:
                outputs.append(batch[:, n_stats:].reshape(self.capacity, y.shape[0], *fn.output_shape[1:]))
                targets.append(y)
                batch = batch[:, :n_stats]
            total = batch if total is None else total + batch
            count += int(y.shape[0])
        values = (total / count).tolist()
        out = {"val_loss": [row[0] for row in values]}
        if self.task.is_classification:
            out["val_accuracy"] = [row[1] for row in values]
        if not metrics:
            return out, {}
        return self._task_metrics(live, metrics, torch.cat(outputs, dim=1), torch.cat(targets), out)

    def _eval_with_outputs(self, stats_fn: Callable) -> tuple[Callable, int]:
        """The evaluation's function when task metrics need the outputs: the
        member's sums, then its outputs flattened; ``fn.output_shape`` holds the
        outputs' shape (one member's, as its forward saw it) once called."""
        n_stats = 2 if self.task.is_classification else 1

        def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            fn.output_shape = tuple(output.shape)
            return torch.cat([stats_fn(output, target), output.float().reshape(-1)])

        return fn, n_stats

    def _task_metrics(self, live: list[int], metrics: dict, outputs: torch.Tensor, targets: torch.Tensor,
                      out: dict[str, list[float]]) -> tuple[dict[str, list[float]], dict[int, str]]:
        """Each task metric of each member in ``live`` on its outputs for the
        whole split. A metric that raises fails that member only (its message
        names the metric and the member); running out of memory in one is
        the group's problem (it is retried smaller), not the metric's."""
        values = {name: [math.nan] * self.capacity for name in metrics}
        errors: dict[int, str] = {}
        for k in live:
            m = self.members[k]
            try:
                for name, metric in metrics.items():
                    values[name][k] = compute_metric(name, metric, outputs[k], targets)
            except MetricError as exc:
                if exc.__cause__ is not None and is_out_of_memory(exc.__cause__):
                    raise exc.__cause__ from None
                errors[k] = (f"{exc} (evaluating the member in slot {k} with seed {m.seed} after its iteration "
                             f"{m.iteration + 1}, config {m.config})")
        return {**out, **values}, errors

    # ----- choosing the route (docs/design.md D8; the decision is chorus_tune/route.py's) ------------------
    def _ensure_route(self, live: list[int]) -> None:
        if not self.routing.needs_probe():
            return
        size = self._group_size(len(live))
        while not self._probe_routes(live, size):
            if size == 1:
                self.routing.settle("eager", RouteReason.PROBE_OUT_OF_MEMORY)
                return
            size = self._limit_group(size)

    def _probe_routes(self, live: list[int], size: int) -> bool:
        """Choose the route by probing ``live`` in groups of ``size``; False if
        that ran out of memory (the state is put back and the memory released).

        Running out of memory says nothing about whether vmap computes the
        same thing: counted as a vmap failure, it would pin the bucket to the
        slow eager route for good.
        """
        try:
            self._decide_route(live, size)
            return True
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is retried
            if not is_out_of_memory(exc):
                raise
        release_memory(self.device)  # outside the except block: see _attempt
        self.oom_recoveries += 1
        return False

    def _candidates(self) -> list[str]:
        """The fused routes to probe: the one running now once timed (a
        newcomer re-checks it), else every fused route the task allows."""
        if self.routing.timed and self.route is not None:
            return [self.route]
        return ["compiled", "vmap"] if self.task.compile else ["vmap"]

    def _decide_route(self, live: list[int], size: int) -> None:
        snapshot = self._snapshot_state()
        self.stack.set_training(True)
        try:
            groups = [live[i:i + size] for i in range(0, len(live), size)]
            # Dropout runs as x * (1 - p), with the rate each route reads: random
            # masks would always differ, and switching dropout off (as the probe
            # did) hid a route that gave a member another member's rate.
            with deterministic_dropout():
                decide(self.routing, self._candidates(), groups, self._probe_step,
                       reset=lambda: self._restore_state(snapshot), sync=self._sync,
                       tolerance=PROBE_TOLERANCE[self.task.precision], is_fatal=is_out_of_memory)
        finally:
            self._restore_state(snapshot)

    def _probe_batch(self, live: list[int], gather: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The probe's batch, shaped as training's: one per member (each its
        own next batch, its order not advanced) with tensor data, else the
        first shared one. A probe on one shared batch would not exercise the
        per-member indexing that training runs."""
        batch = self.task.batch_size_for(self.members[live[0]].config)
        if not isinstance(self._train, TensorSplit):
            x, y = first_batch(self._train, batch)
            return x.to(self.device), y.to(self.device), True
        index = torch.zeros(self.capacity, batch, dtype=torch.long)
        for k in live:
            index[k] = self.members[k].order.peek()
        rows = index.to(self.device)
        if gather:
            rows = rows[live]
        x, y = self._train.tensors
        return x[rows], y[rows], False

    def _probe_step(self, route: str, live: list[int]) -> ProbeResult:
        """One training step of ``live`` on the probe batch: their losses and
        their rows of every state tensor afterwards."""
        gather = self._gathers(live, route)
        x, y, shared = self._probe_batch(live, gather)
        active = self._active_mask(live)
        lr = torch.tensor([self.members[k].hp["lr"] if k in live else 0.0 for k in range(self.capacity)],
                          device=self.device)
        losses_ = self._train_step(x, y, shared, lr, active, live, route, gather, self._smoothing(live)).detach()
        rows = torch.tensor(live, device=self.device)
        return ProbeResult(losses_[rows], [t.detach()[rows] for t in self.stack.state_tensors()])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _snapshot_state(self, rows: list[int] | None = None, to_host: bool = False) -> _Snapshot:
        """Copies of every stack and optimizer tensor (of ``rows`` only, if
        given), for :meth:`_restore_state`.

        ``to_host``: an iteration's safety net must not itself take the device
        memory it guards; the route probe, which restores a dozen times, keeps
        its copies on the device.
        """
        return _Snapshot(self.stack.snapshot(rows, to_host), self.optimizer.snapshot(rows, to_host))

    def _restore_state(self, snapshot: _Snapshot) -> None:
        self.stack.restore(snapshot.stack)
        self.optimizer.restore(snapshot.optimizer)


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@dataclass(frozen=True)
class _Objectives:
    """What a fused call computes per member, built on one form of the loss:
    ``train`` (mean loss), ``smoothed`` (``losses.smoothing_parts``, only for
    members with label smoothing) and ``evaluate`` (sums on a batch)."""

    train: Callable
    smoothed: Callable
    evaluate: Callable

    @classmethod
    def of(cls, loss_fn: Callable, classification: bool) -> "_Objectives":
        return cls(mean_loss(loss_fn), losses.smoothing_parts(loss_fn), _eval_stats(loss_fn, classification))


def _eval_stats(loss_fn: Callable, classification: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A member's evaluation sums on one batch: its summed loss (and, for
    classification, its count of correct predictions)."""
    def stats(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss_sum = loss_fn(output, target).float().sum()
        if not classification:
            return loss_sum.reshape(1)
        return torch.stack([loss_sum, losses.accuracy_count(output, target).to(loss_sum.dtype)])
    return stats
