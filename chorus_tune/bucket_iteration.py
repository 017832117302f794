"""A bucket's part that runs an iteration (docs/design.md D5, D8, D13): its plan drawn once,
the live rows gathered into a smaller stack or a lone member stepped on its own, groups
retried smaller after running out of memory, failing members set apart. A part of
:class:`~chorus_tune.bucket.Bucket` (its state is the bucket's, set in its ``__init__``)."""
from __future__ import annotations

import copy
import time
from typing import Any

import torch

from .bucket_values import (
    STACK_ROUTES,
    IterationPlan,
    MemberFailure,
    MemberMetricError,
    MemberOutOfMemory,
    describe_error,
)
from .memory import describe_memory, is_out_of_memory, release_memory
from .unfused import ROUTE as UNFUSED


class IterationRunner:
    """One iteration: planned, grouped, gathered, retried (Bucket's part; see the module)."""

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

    def _metric_failure(self, plan: IterationPlan, results: dict[int, dict[str, Any]]) -> str:
        slots = sorted(plan.metric_errors)
        return (f"a task metric failed on the evaluation of {len(slots)} member(s) "
                f"({'; '.join(plan.metric_errors[k] for k in slots)}); {len(results)} other member(s) completed "
                "this iteration (.results)")

    def _plan(self, live: list[int]) -> IterationPlan:
        first = self.members[live[0]]
        steps = self.task.steps_per_iteration(first.config)
        orders = {k: self.members[k].order.state_dict() for k in live if self.members[k].order is not None}
        lr = self._lr_table(live, steps)  # before the batch orders move: it may raise
        try:
            index = self._index_table(live, steps)  # advances the batch orders
        except BaseException:
            self._rewind_orders(orders)  # no member may lose its place in the data
            raise
        return IterationPlan(live, steps, lr, index, orders, smoothing=self._smoothing(live))

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

    def _train_in_groups(self, plan: IterationPlan) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """Train ``plan.live`` in groups of at most ``max_group``; after an
        out-of-memory error, put the group back and retry it at half the size.

        Why: a fused step's memory grows with the number of members it runs,
        so running out says the group is too big, not that a member is bad.
        Each smaller group is exact (members outside it are frozen), so every
        member still makes exactly this iteration's progress. Only a member
        that runs out alone is given up on: ``(results, {slot: error})``.
        """
        size = self._group_size(len(plan.live))
        if self._trains_one_by_one(size):
            size = 1  # each member alone, unfused: cheaper at this size, as measured (group_costs.py)
        pending = list(plan.live)
        results: dict[int, dict[str, Any]] = {}
        failed: dict[int, str] = {}
        while pending:
            group = pending[:size]
            started, timing = time.perf_counter(), self.routing.timing
            out, error = self._attempt(group, plan)
            if out is not None:
                if not timing:  # a group that timed the routes cost what no route costs
                    self.group_costs.record(self._route_for(group), len(group), time.perf_counter() - started)
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

    def _attempt(self, group: list[int], plan: IterationPlan) -> tuple[dict[int, dict[str, Any]] | None, str | None]:
        """Train ``group`` through ``plan``: ``(metrics, None)``, or, if it ran
        out of memory, ``(None, error)`` with the group's rows put back.

        The rows are put back and the memory released only after the
        ``except`` block: inside it, the exception's traceback still holds the
        failed step's frames, and with them every activation tensor.
        """
        route = self._route_for(group)
        if route == UNFUSED:
            return self._attempt_unfused(group[0], plan)
        if self._trains_gathered(group, route):
            return self._attempt_gathered(group, plan, route)
        gather = self._gathers(group, route)
        start = None
        try:
            start = self._snapshot_state(self._rows_touched(group, gather), to_host=True)
            out = self._train_group(group, plan, gather, route)
            self._ran(route, self.capacity if route in STACK_ROUTES and not gather else len(group))
            return out, None
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is retried
            if not is_out_of_memory(exc):
                if start is not None:  # an iteration that raises leaves every member where it was
                    self._restore_state(start)
                raise
            error = describe_error(exc)
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

    @property
    def last_routes(self) -> int:
        """How many routes the last iteration ran (more than one: a probe
        timed its candidates, or its groups differed)."""
        return len(self._last_routes)

    def _ran(self, route: str, rows: int) -> None:
        self.last_rows += rows
        self._last_routes.add(route)

    def _route_for(self, group: list[int]) -> str:
        """The route ``group`` trains on this time: the bucket's, except that a
        lone member of an ``"auto"`` bucket trains unfused (its own module and
        torch's optimizer, chorus_tune/bucket_lone.py says why and where not:
        there the eager route, its own module through the stack). Why not vmap:
        over one row it only adds the batching around the same arithmetic;
        measured on the 2-core CPU, a width-64 MLP's epoch took 0.20 s on vmap
        against 0.15 s eager. A route asked for is kept whatever the count (the
        tests pin it)."""
        if len(group) == 1 and self.routing.requested == "auto":
            return self._lone_route()
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

    def _attempt_gathered(self, group: list[int], plan: IterationPlan,
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
            error = describe_error(exc)
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

    def _gathered(self, group: list[int]) -> "IterationRunner":
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
        return self.max_group is not None and route in STACK_ROUTES and len(group) < self.capacity

    def _rows_touched(self, group: list[int], gather: bool) -> list[int] | None:
        """The rows training ``group`` can change (``None``: all of them): the
        group's own, except that a full-stack vmap also writes every row's
        BatchNorm statistics (put back only at the end of the group)."""
        if len(group) == self.capacity or (self.route in STACK_ROUTES and not gather):
            return None
        return group

    def _train_group(self, group: list[int], plan: IterationPlan, gather: bool,
                     route: str) -> dict[int, dict[str, Any]]:
        active = self._active_mask(group)
        # The full-stack forward updates BatchNorm statistics of every row,
        # empty ones too; the rows of members outside the group are put back so
        # they stay frozen. A gathered forward touches the group's rows only.
        others = [k for k in range(self.capacity) if k not in group]
        frozen = None if gather or not others else self.stack.snapshot_buffers(others)
        self.stack.set_training(True)
        loss_sum = torch.zeros(self.capacity, device=self.device)
        # The bucket's route still being timed (not a lone member's): each step
        # takes the route the timing asks for, and the rest the one it kept.
        timing = self.routing.timing and route == self.route
        for s in range(plan.steps):
            x, y, shared = self._batch(plan, s, group if gather else None)
            if timing and self.routing.timing:
                loss_sum += self._timed_step(x, y, shared, plan.lr[s], active, group, gather, plan.smoothing)
                continue
            route = self.route if timing else route
            loss_sum += self._train_step(x, y, shared, plan.lr[s], active, group, route, gather,
                                         plan.smoothing).detach()
        if frozen is not None:
            self.stack.restore_buffers(frozen)
        route = self.route if timing else route
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

    def _timed_step(self, x, y, shared: bool, lr: torch.Tensor, active: torch.Tensor, group: list[int],
                    gather: bool, smoothing: torch.Tensor | None) -> torch.Tensor:
        """One training step on the route the timing asks for next
        (:meth:`RouteChoice.step_route`), timed: every candidate agreed with
        eager on the probe, so any of them may train the step."""
        route = self.routing.step_route()
        self._last_routes.add(route)  # the iteration's status line names every route it ran
        self._sync()
        started = time.perf_counter()
        losses = self._train_step(x, y, shared, lr, active, group, route, gather, smoothing).detach()
        self._sync()
        self.routing.record_step(route, time.perf_counter() - started)
        return losses

    def _member_out_of_memory(self, plan: IterationPlan, failed: dict[int, str],
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
