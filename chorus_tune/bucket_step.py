"""A bucket's part that computes (docs/design.md D6): one fused training step of the members
in a group (their batches, learning rates and masks), and the evaluation pass with the task's
metrics. A part of :class:`~chorus_tune.bucket.Bucket` (its state is the bucket's)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from .bucket_values import (
    IterationPlan,
    Objectives,
)
from .data import eval_batches, take_rows
from .memory import is_out_of_memory
from .optim import scheduled_lr
from .precision import autocast
from .task_metrics import MetricError, compute_metric


class FusedStep:
    """The fused train step and the evaluation pass (Bucket's part; see the module)."""

    def _active_mask(self, live: list[int]) -> torch.Tensor:
        active = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        active[live] = True
        return active

    def _lr_table(self, live: list[int], steps: int) -> torch.Tensor:
        # Rows built as Python lists, the table in one go: writing it element
        # by element took about 2 us a write, 8 ms of a 16-member iteration.
        rows = [[0.0] * self.capacity for _ in range(steps)]
        for k in live:
            m = self.members[k]
            for s in range(steps):
                rows[s][k] = scheduled_lr(m.hp["lr"], m.hp["schedule"], m.step + s)
        return torch.tensor(rows, dtype=torch.float32).reshape(steps, self.capacity).to(self.device)

    def _index_table(self, live: list[int], steps: int) -> torch.Tensor | None:
        if self._shared is not None:
            return None
        batch = self.task.batch_size_for(self.members[live[0]].config)
        table = torch.zeros(steps, self.capacity, batch, dtype=torch.long)
        for k in live:
            table[:, k] = self.members[k].order.take(steps)
        return table.to(self.device)

    def _batch(self, plan: IterationPlan, s: int, rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Step ``s``'s batch: shared, or one per row (only ``rows``' rows, if given)."""
        if plan.index is None:
            while len(plan.tape) <= s:
                plan.tape.append(self._shared.next())
            x, y = plan.tape[s]
            return x.to(self.device), y.to(self.device), True
        x, y = self._train.tensors
        idx = plan.index[s] if rows is None else plan.index[s, rows]
        return take_rows(x, idx), take_rows(y, idx), False

    def _objectives(self, route: str | None) -> "Objectives":
        if route == "batched":
            return self._batched_fns
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
