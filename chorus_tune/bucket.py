"""A bucket: up to ``capacity`` members of one structure, trained fused."""
from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import losses
from .bucket_iteration import IterationRunner
from .bucket_lone import LoneMember
from .bucket_padding import PaddedMembers
from .bucket_route import RouteProbe
from .bucket_step import FusedStep
from .bucket_values import (
    STATE_FORMAT,
    Member,
    MemberFailure,
    MemberMetricError,
    MemberOutOfMemory,
    Objectives,
)
from .data import BatchOrder, SharedBatches
from .group_costs import GroupCosts
from .member_spec import MemberSpec
from .member_state import check_member_state, check_state_fits
from .optim import StackedOptimizer
from .route import ROUTES, RouteChoice, RouteReason
from .seeds import chosen_seed
from .stack import MemberStack, StructuralKey, describe_split, module_key
from .task import Task, TensorSplit
from .width_rule import DEFAULT_RULE, WidthRule
from .widths import Profile, padding_family, shapes_of

__all__ = ["Bucket", "MemberFailure", "MemberMetricError", "MemberOutOfMemory", "ROUTES", "RouteReason",
           "STATE_FORMAT"]


class Bucket(PaddedMembers, IterationRunner, LoneMember, FusedStep, RouteProbe):
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
        self._eager_fns = Objectives.of(self._loss, task.is_classification)
        self._vmap_fns = Objectives.of(losses.vmap_form(self._loss), task.is_classification)
        # The batched route trains on a named loss over the whole stack at once;
        # the rest (smoothing parts, evaluation sums) runs under vmap as on vmap.
        stacked = losses.stacked_mean_loss(self._loss)
        self._batched_fns = self._vmap_fns if stacked is None else replace(self._vmap_fns, train=stacked)
        self.fused_steps = 0
        # Rows the last iteration computed (a masked row of a full-stack call
        # counts: it costs as much as a live one); its members trained are
        # fewer where rows ran masked.
        self.last_rows = 0
        self._last_routes: set[str] = set()  # the routes the last iteration's groups took
        self.max_group: int | None = None
        self.oom_recoveries = 0
        # Seconds per member-iteration by route and group size, as measured here (group_costs.py).
        self.group_costs = GroupCosts()
        # (slot, member, UnfusedMember): the last lone member's unfused copy (bucket_lone.py).
        self._unfused_held: tuple[int, Member, Any] | None = None

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

    def retire(self, slot: int) -> None:
        """Free ``slot``; its tensors stay frozen until another member takes it. Idempotent."""
        if 0 <= slot < self.capacity and self.members[slot] is not None:
            self.members[slot] = None
            self.stack.clear(slot)
            self._forget_unfused(slot)

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
        self._forget_unfused()
        return {old: new for new, old in enumerate(live)}
