"""A bucket's part that trains a lone member unfused (docs/design.md D8, issue 39): when
an ``"auto"`` bucket's iteration trains one member alone, that member trains as the
reference trains it (its own module, the stock ``torch.optim`` optimizer:
:class:`~chorus_tune.unfused.UnfusedMember`), starting from its state in the stack and
written back into its rows afterwards. A part of :class:`~chorus_tune.bucket.Bucket`
(its state is the bucket's, set in its ``__init__``).

Why: a one-row eager step through the stack still pays for the stack (the tensor swaps of
``functional_call``, a row select per parameter, the stacked optimizer's per-member
views). Measured on the 2-core machine, one thread, batch 64, an epoch of a lone member
took 0.16-0.24 s in the stack against 0.10-0.15 s unfused (width-64 MLP), and 0.32
against 0.23-0.24 s (two hidden layers); reading its state out, training it unfused
and reading it back cost no more than the unfused epoch alone. Under stock schedulers
Tune continues members one trial at a time, so a bucket often trains one member alone.

Where it does not apply, the lone member stays on the eager route: a route asked for
(the tests pin routes), and shared batches (a ``Dataset`` split: the bucket draws one
stream of batches for all members, which a member trained on its own would not see).
Nor before ``torch.optim``'s first use is paid in the process (``torch._dynamo``
imported: ``unfused.torch_optim_ready``): the import took 1.0 s alone on the 2-core
machine, and 3.2-3.5 s for the last survivor of each of two buckets under ChorusASHA
(128 trials, ``synth-mlp64``: their first unfused iteration against 0.09 s for the next),
at the very end of the sweep, where a bucket decides its own rungs and never waits to
warm it (``warm_unfused``, called while a bucket waits for Tune). The eager epoch costs
a fifth more (0.113 s against 0.094 s, width-64 MLP): the import buys that back only
after some 50 epochs alone.
"""
from __future__ import annotations

from typing import Any

from .bucket_values import IterationPlan, describe_error
from .memory import is_out_of_memory, release_memory
from .task import TensorSplit
from .task_metrics import MetricError
from .unfused import ROUTE as UNFUSED
from .unfused import UnfusedMember, torch_optim_ready, warm_torch_optim


class LoneMember:
    """A lone member's iteration, unfused (Bucket's part; see the module)."""

    def _lone_route(self) -> str:
        """The route a lone member of an ``"auto"`` bucket takes: unfused
        where it may, once ``torch.optim`` is warm in this process (see the module)."""
        return UNFUSED if self.may_train_unfused() and torch_optim_ready() else "eager"

    def may_train_unfused(self) -> bool:
        """Whether a member of this bucket may train unfused: an ``"auto"``
        bucket on a split of tensors (where it is alone, or where
        ``group_costs`` measured that cheaper)."""
        return self.routing.requested == "auto" and isinstance(self._train, TensorSplit)

    def warm_unfused(self) -> bool:
        """Pay now what the first member trained unfused would pay in this
        process (``unfused.warm_torch_optim``), where one may train unfused.
        For a bucket to call while it waits: whether it warmed."""
        if not self.may_train_unfused():
            return False
        warm_torch_optim()
        return True

    def _trains_one_by_one(self, members: int) -> bool:
        """Whether a group of ``members`` of an ``"auto"`` bucket trains one
        member at a time, unfused: where this bucket has measured that cheaper
        per member than its route at that group size (chorus_tune/group_costs.py),
        and not while its routes are timed on training's steps (one by one,
        the timing would never end). A route asked for is kept (the tests pin it); the compiled route is
        left to its own probe."""
        return (members > 1 and self._lone_route() == UNFUSED and self.route in ("vmap", "batched", "eager")
                and not self.routing.timing and self.group_costs.trains_unfused(self.route, members))

    def _attempt_unfused(self, slot: int, plan: IterationPlan) -> tuple[dict[int, dict[str, Any]] | None, str | None]:
        """:meth:`_attempt` for a lone member trained unfused: ``({slot:
        metrics}, None)``, or ``(None, error)`` if it ran out of memory. The
        stack changes only once the member has trained: an iteration that
        raises leaves its rows as they were."""
        member = self.members[slot]
        state = self.member_state(slot)
        # The plan has taken this iteration's batches from the member's order
        # already: the unfused run takes them itself, from where they started.
        state["data"] = plan.orders.get(slot)
        metric_error = None
        try:
            runner = self._unfused_runner(slot)
            runner.load(state)
            try:
                metrics = runner.run_iteration()
            except MetricError as exc:
                if exc.__cause__ is not None and is_out_of_memory(exc.__cause__):
                    raise exc.__cause__ from None
                metrics, metric_error = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is retried
            if not is_out_of_memory(exc):
                raise
            error = describe_error(exc)
        else:
            self._write_back(slot, runner)
            member.iteration, member.step = runner.iteration, runner.step
            self.fused_steps += plan.steps
            self._ran(UNFUSED, 1)
            if metric_error is not None:
                plan.metric_errors[slot] = (f"{metric_error} (evaluating the member in slot {slot} with seed "
                                            f"{member.seed} after its iteration {member.iteration}, config "
                                            f"{member.config})")
                return {}, None
            return {slot: metrics}, None
        # The unfused copy's model and optimizer state go with the failed
        # step's tensors: a member that ran out alone should not keep a second
        # copy of itself on the device.
        self._forget_unfused(slot)
        runner = None  # this frame's reference too, before the memory is given back
        release_memory(self.device)
        self.oom_recoveries += 1
        return None, error

    def _unfused_runner(self, slot: int) -> UnfusedMember:
        """The slot's member as an :class:`UnfusedMember` (its model and
        optimizer; the data is the bucket's), kept for its next iteration
        alone. One at a time: each is a second copy of a member's model and
        optimizer state, which a bucket's memory fit (D13) does not count."""
        member = self.members[slot]
        held = self._unfused_held
        if held is None or held[0] != slot or held[1] is not member:
            self._unfused_held = None  # the old copy goes before the new one is built
            runner = UnfusedMember(self.task, member.config, member.seed, device=self.device,
                                   splits=(self._train, self._val))
            self._unfused_held = held = (slot, member, runner)
        return held[2]

    def _forget_unfused(self, slot: int | None = None) -> None:
        """Drop the unfused copy of ``slot``'s member (any slot's: ``None``),
        whose slot it no longer is (retired, or renumbered by compaction)."""
        if self._unfused_held is not None and slot in (None, self._unfused_held[0]):
            self._unfused_held = None

    def _write_back(self, slot: int, runner: UnfusedMember) -> None:
        """The unfused member's weights, buffers and optimizer state into ``slot``'s rows."""
        member = self.members[slot]
        self.stack.put_tensors(slot, runner.model)
        self.optimizer.set_member(slot, member.hp, runner.optimizer_state())
