"""A bucket: up to ``capacity`` members of one structure, trained fused, in lockstep."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import losses
from .data import BatchOrder, SharedBatches, eval_batches, first_batch
from .optim import StackedOptimizer, hyperparameters, scheduled_lr
from .stack import MemberStack, mean_loss, module_key
from .task import Task, TensorSplit

ROUTES = ("auto", "vmap", "eager")
STATE_FORMAT = 1

# How far the two routes may disagree on the probe and still count as the same
# computation: batched and unbatched matmuls sum in different orders (~1e-7
# relative), while a real mismatch (a member whose forward reads its own
# attributes) is off by the size of the activations.
_PROBE_RTOL, _PROBE_ATOL = 1e-3, 1e-5
_TIMING_REPEATS = 5


@dataclass
class Member:
    config: dict
    seed: int
    family: str
    hp: dict[str, Any]
    iteration: int
    step: int
    order: BatchOrder | None


class Bucket:
    """Up to ``capacity`` members that share a structural key, trained as one.

    Members are added with :meth:`add` (new, or restored from a
    :meth:`member_state`), trained one iteration at a time by
    :meth:`run_iteration` (all live members in lockstep, fused), and removed
    with :meth:`retire`. A retired or empty slot is masked, never reshaped: its
    parameters, buffers and optimizer state stay bit-for-bit frozen.
    :meth:`compact` drops empty slots between iterations.

    ``route`` is ``"auto"`` (check vmap against an eager loop on a probe batch,
    fall back to eager on any mismatch or error, else keep the faster),
    ``"vmap"`` or ``"eager"``.
    """

    def __init__(self, task: Task, capacity: int, device: str | torch.device = "cpu", route: str = "auto"):
        if capacity < 1:
            raise ValueError(f"capacity must be positive; got {capacity}")
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}; got {route!r}")
        self.task, self.capacity, self.device = task, capacity, torch.device(device)
        self.requested_route = route
        self.route: str | None = None if route == "auto" else route
        self.route_reason = "requested" if route != "auto" else "undecided"
        self._timed = False
        self._route_checked = route != "auto"
        self.key: tuple | None = None
        self.model_name: str | None = None
        self.members: list[Member | None] = [None] * capacity
        self.stack: MemberStack | None = None
        self.optimizer: StackedOptimizer | None = None
        self._train = self._val = None
        self._shared: SharedBatches | None = None
        self._loss = task.loss_fn
        self.fused_steps = 0

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
    def add(self, config: dict, seed: int | None = None, state: dict | None = None) -> int:
        """Take a new member (or restore one from ``state``) into a free slot.

        Raises whatever the model factory raises, ``ValueError`` for a config
        of another structure or a full bucket; the bucket is unchanged then.
        """
        config = dict(state["config"] if state is not None and config is None else config)
        if state is not None:
            seed = state["seed"]
        elif seed is None:
            seed = int(config["seed"]) if "seed" in config else secrets.randbelow(2**31)
        free = self.free_slots
        if not free:
            raise ValueError(f"bucket is full ({self.capacity} members)")
        family = self.task.optimizer_for(config)
        hp = hyperparameters(family, config)
        module = self.task.build_model(config, seed)  # the factory's own error propagates
        if state is not None:
            module.load_state_dict(state["model"])
        key = module_key(self.task, config, module)  # the model is built already: no second build
        if self.key is not None and key != self.key:
            raise ValueError(
                f"config {config} does not share this bucket's structure ({self.model_name}): "
                "its parameters, buffers, batch size, optimizer or loss differ"
            )
        if self.stack is None:
            self._materialise(module, key, config)
        slot = free[0]
        order = None
        if isinstance(self._train, TensorSplit):
            order = BatchOrder(len(self._train), self.task.batch_size_for(config), seed)
            if state is not None and state.get("data") is not None:
                order.load_state_dict(state["data"])
        self.stack.put(slot, module.to(self.device))
        self.optimizer.set_member(slot, hp, None if state is None else state["optimizer"])
        self.members[slot] = Member(
            config=config, seed=int(seed), family=family, hp=hp,
            iteration=0 if state is None else int(state["iteration"]),
            step=0 if state is None else int(state["step"]),
            order=order,
        )
        if self.requested_route == "auto":
            self._route_checked = False  # a newcomer may not be vmap-compatible with the rest
        return slot

    def _materialise(self, template: nn.Module, key: tuple, config: dict) -> None:
        self.key, self.model_name = key, type(template).__name__
        train, val = self.task.load_data()
        self._train = train.to(self.device) if isinstance(train, TensorSplit) else train
        self._val = val.to(self.device) if isinstance(val, TensorSplit) else val
        if not isinstance(train, TensorSplit):
            self._shared = SharedBatches(train, self.task.batch_size_for(config), self.task.data_seed)
        self.stack = MemberStack(template, self.capacity, self.device)
        by_identity = {id(t): n for n, t in (*template.named_parameters(), *template.named_buffers())}
        entries = template.state_dict(keep_vars=True)
        # None: the state_dict holds more than tensors of the stack (extra state):
        # then a member's state goes through a real model build.
        self._state_names = ({key: by_identity[id(t)] for key, t in entries.items()}
                             if all(id(t) in by_identity for t in entries.values()) else None)
        self.optimizer = StackedOptimizer(key[4], self.stack.params)

    # ----- members out ----------------------------------------------------------------------------
    def retire(self, slot: int) -> None:
        """Free ``slot``; its tensors stay frozen until another member takes it. Idempotent."""
        if 0 <= slot < self.capacity and self.members[slot] is not None:
            self.members[slot] = None
            self.stack.clear(slot)

    def member_state(self, slot: int) -> dict[str, Any]:
        """Everything that makes this member itself, portable to any slot of
        any bucket of the same structure (DESIGN D7)."""
        member = self._member(slot)
        return {
            "format": STATE_FORMAT,
            "config": dict(member.config),
            "seed": member.seed,
            "model": (self._state_dict_rows(slot) if self._state_names is not None
                      else self.export_model(slot).state_dict()),
            "optimizer": self.optimizer.member_state(slot),
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
            source = self.stack.params[name] if name in self.stack.params else self.stack.buffers[name]
            rows[key] = source[slot].detach().to("cpu", copy=True)
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
        """
        if slots is None:
            live = self.live_slots
        else:
            live = sorted(set(slots))
            for k in live:
                self._member(k)  # a KeyError for a slot that holds no member
        if not live:
            return {}
        # Probe with every live member, not only this iteration's: a newcomer
        # that sits this one out must still be checked against vmap.
        self._ensure_route(self.live_slots)
        first = self.members[live[0]]
        steps = self.task.steps_per_iteration(first.config)
        active = self._active_mask(live)
        lr_table = self._lr_table(live, steps)
        index_table = self._index_table(live, steps)
        frozen = self._snapshot_buffers([k for k in range(self.capacity) if k not in live])
        self.stack.set_training(True)
        loss_sum = torch.zeros(self.capacity, device=self.device)
        for s in range(steps):
            x, y, shared = self._batch(index_table, s)
            loss_sum += self._train_step(x, y, shared, lr_table[s], active, live, self.route).detach()
        self._restore_buffers(frozen)
        self.fused_steps += steps
        for k in live:
            self.members[k].iteration += 1
            self.members[k].step += steps
        val = self._evaluate(live)
        train_loss = (loss_sum / steps).tolist()
        out = {}
        for k in live:
            m = self.members[k]
            metrics = {"train_loss": train_loss[k], **{n: v[k] for n, v in val.items()},
                       "iteration": m.iteration, "route": self.route, "seed": m.seed}
            out[k] = metrics
        return out

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

    def _batch(self, index_table: torch.Tensor | None, s: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        if index_table is None:
            x, y = self._shared.next()
            return x.to(self.device), y.to(self.device), True
        x, y = self._train.tensors
        idx = index_table[s]
        return x[idx], y[idx], False

    def _train_step(self, x, y, shared: bool, lr: torch.Tensor, active: torch.Tensor,
                    live: list[int], route: str) -> torch.Tensor:
        for p in self.stack.params.values():
            p.grad = None
        objective = mean_loss(self._loss)
        if route == "vmap":
            member_losses = self.stack.vmap_call(objective, x, y, shared, template=live[0])
        else:
            member_losses = self.stack.eager_call(objective, x, y, shared, live)
        # Sum, not mean, over members: each member's gradient keeps the scale of
        # its unfused run (a mean would divide every learning rate by K).
        torch.where(active, member_losses, torch.zeros_like(member_losses)).sum().backward()
        self.optimizer.step(lr, active, live)
        return member_losses

    def _snapshot_buffers(self, slots: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        # Forward passes update BatchNorm statistics of every row, empty ones too;
        # put the rows of inactive slots back so they stay frozen.
        if not slots or not self.stack.buffers:
            return None
        rows = torch.tensor(slots, device=self.device)
        return rows, {n: b[rows].clone() for n, b in self.stack.buffers.items()}

    def _restore_buffers(self, frozen: tuple[torch.Tensor, dict[str, torch.Tensor]] | None) -> None:
        if frozen is None:
            return
        rows, saved = frozen
        for n, values in saved.items():
            self.stack.buffers[n][rows] = values

    @torch.no_grad()
    def _evaluate(self, live: list[int]) -> dict[str, list[float]]:
        self.stack.set_training(False)
        classification = self.task.is_classification
        loss_fn = self._loss

        def stats(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss_sum = loss_fn(output, target).sum()
            if not classification:
                return loss_sum.reshape(1)
            return torch.stack([loss_sum, losses.accuracy_count(output, target).to(loss_sum.dtype)])

        total, count = None, 0
        for x, y in eval_batches(self._val, self.task.eval_batch_size, self.device):
            if self.route == "vmap":
                batch_stats = self.stack.vmap_call(stats, x, y, True, template=live[0])
            else:
                batch_stats = self.stack.eager_call(stats, x, y, True, live)
            total = batch_stats if total is None else total + batch_stats
            count += int(y.shape[0])
        values = (total / count).tolist()
        out = {"val_loss": [row[0] for row in values]}
        if classification:
            out["val_accuracy"] = [row[1] for row in values]
        return out

    # ----- choosing the route (DESIGN D8) ---------------------------------------------------------
    def _ensure_route(self, live: list[int]) -> None:
        if self._route_checked:
            return
        self._route_checked = True
        if self.route == "eager" and self.route_reason != "faster":
            return  # already fell back for a mismatch: stays eager
        if self.route == "eager" and self._timed:
            return  # eager was faster; eager is always correct for newcomers
        snapshot = self._snapshot_state()
        self.stack.set_training(True)
        switched = self.stack.disable_dropout()
        try:
            agree, reason = self._probe_agrees(live, snapshot)
            if not agree:
                self.route, self.route_reason = "eager", reason
            elif not self._timed:
                self._timed = True
                self.route_timings = self._time_routes(live, snapshot)
                faster = min(self.route_timings, key=self.route_timings.get)
                self.route, self.route_reason = faster, "faster"
        finally:
            for m in switched:
                m.train()
            self._restore_state(snapshot)

    def _probe_step(self, route: str, live: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        x, y = first_batch(self._train, self.task.batch_size_for(self.members[live[0]].config))
        x, y = x.to(self.device), y.to(self.device)
        active = self._active_mask(live)
        lr = torch.tensor([self.members[k].hp["lr"] if k in live else 0.0 for k in range(self.capacity)],
                          device=self.device)
        losses_ = self._train_step(x, y, True, lr, active, live, route).detach()
        return [t.detach().clone() for t in self.stack.state_tensors()], losses_

    def _probe_agrees(self, live: list[int], snapshot: tuple) -> tuple[bool, str]:
        eager_state, eager_losses = self._probe_step("eager", live)
        self._restore_state(snapshot)
        try:
            vmap_state, vmap_losses = self._probe_step("vmap", live)
        except Exception as exc:  # an op without a batching rule, data-dependent control flow, ...
            return False, f"vmap failed: {type(exc).__name__}: {exc}"
        finally:
            self._restore_state(snapshot)
        rows = torch.tensor(live, device=self.device)
        pairs = [(eager_losses, vmap_losses), *zip(eager_state, vmap_state)]
        for a, b in pairs:
            a, b = a[rows], b[rows]
            if a.is_floating_point():
                if not torch.allclose(a, b, rtol=_PROBE_RTOL, atol=_PROBE_ATOL, equal_nan=True):
                    return False, "vmap disagreed with the per-member loop on the probe batch"
            elif not torch.equal(a, b):
                return False, "vmap disagreed with the per-member loop on the probe batch"
        return True, "agrees"

    def _time_routes(self, live: list[int], snapshot: tuple) -> dict[str, float]:
        # Interleaved and best-of-N: a single timing of each route picked the
        # slow one on a loaded 2-core machine.
        best = {"vmap": float("inf"), "eager": float("inf")}
        for _ in range(_TIMING_REPEATS):
            for route in best:
                self._sync()
                start = time.perf_counter()
                self._probe_step(route, live)
                self._sync()
                best[route] = min(best[route], time.perf_counter() - start)
                self._restore_state(snapshot)
        return best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _snapshot_state(self) -> tuple:
        return [t.detach().clone() for t in self.stack.state_tensors()], self.optimizer.snapshot()

    def _restore_state(self, snapshot: tuple) -> None:
        stack_saved, optimizer_saved = snapshot
        with torch.no_grad():
            for t, saved in zip(self.stack.state_tensors(), stack_saved):
                t.copy_(saved)
            self.optimizer.restore(optimizer_saved)
        for p in self.stack.params.values():
            p.grad = None
