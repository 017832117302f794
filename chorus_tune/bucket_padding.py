"""A bucket's part that builds its stack and pads widths (docs/design.md D9): the first
member's module becomes the stack, members of other widths are embedded in its widest
shapes (checked against their own model first), and what each pays for padding. A part of
:class:`~chorus_tune.bucket.Bucket` (its state is the bucket's, set in its ``__init__``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .bucket_values import (
    STACK_ROUTES,
)
from .data import SharedBatches, first_batch
from .optim import StackedOptimizer
from .padding import padding_disagreement
from .route import PROBE_TOLERANCE, RouteReason
from .stack import MemberStack, StructuralKey, module_tensors
from .task import TensorSplit
from .widths import Cost, Profile, padding_family, shapes_of, widen, widest


class PaddedMembers:
    """The stack built, widths padded and priced (Bucket's part; see the module)."""

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
        stack = MemberStack(template, self.capacity, self.device)
        if self.routing.requested == "batched" and not stack.batched.eligible:
            raise ValueError(f"route='batched' cannot run {type(template).__name__}: {stack.batched.why} "
                             "(chorus_tune/batched.py); use route='auto' or 'vmap'")
        self.stack = stack
        self._batch_size = self.task.batch_size_for(config)
        by_identity = {id(t): n for n, t in (*template.named_parameters(), *template.named_buffers())}
        entries = template.state_dict(keep_vars=True)
        # None: the state_dict holds more than tensors of the stack (extra state):
        # then a member's state goes through a real model build.
        self._state_names = ({key: by_identity[id(t)] for key, t in entries.items()}
                             if all(id(t) in by_identity for t in entries.values()) else None)
        self.optimizer = StackedOptimizer(key.optimizer, self.stack.params)

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
            if self.padding_mismatch == "refuse" or self.routing.requested in STACK_ROUTES:
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
        self.routing.forget_timing()

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
