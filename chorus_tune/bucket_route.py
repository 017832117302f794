"""A bucket's part that chooses its route (docs/design.md D8): the probe runs each candidate
route on the live members from one snapshot, checks it against the eager step and times it;
the fastest that agrees is kept, and the report says why. A part of
:class:`~chorus_tune.bucket.Bucket` (its state is the bucket's); the rule itself is
:func:`chorus_tune.route.decide`."""
from __future__ import annotations

from typing import Any

import torch

from .bucket_values import (
    Snapshot,
)
from .configuration import deterministic_dropout
from .data import first_batch, take_rows
from .memory import is_out_of_memory, release_memory
from .route import PROBE_TOLERANCE, ProbeResult, RouteReason, decide
from .task import TensorSplit


class RouteProbe:
    """The route probed and chosen (Bucket's part; see the module)."""

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
            report["batched"] = {"eligible": self.stack.batched.eligible, "why_not": self.stack.batched.why}
        return report

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
        routes = ["compiled", "vmap"] if self.task.compile else ["vmap"]
        return ["batched", *routes] if self.stack.batched.eligible else routes

    def _probes_gathered(self, live: list[int], size: int) -> bool:
        """Whether the probe runs on a gathered stack of ``live``'s rows: when
        training would run every candidate route there (``_trains_gathered``).
        Why: a probe on the whole stack timed vmap over every row, masked ones
        included, against eager over the live members only. Measured on the
        2-core CPU with 8 live members of 16 (two-hidden-layer MLP of width
        256): vmap 26.3 ms a probe step against eager's 24.5, so the bucket
        settled on eager and trained at 2.1-3.0 s an iteration, where its
        gathered vmap iteration takes 1.6 s."""
        return (len(live) < self.capacity and size >= len(live)
                and all(self._trains_gathered(live, route) for route in self._candidates()))

    def _decide_route(self, live: list[int], size: int, time_in_training: bool | None = None) -> None:
        if time_in_training is None:
            time_in_training = self._times_in_training(live, size)
        if self._probes_gathered(live, size):
            # A copy of the live rows (the bucket's own stay as they are); the
            # routing it settles is the bucket's (the view shares it).
            self._gathered(live)._decide_route(list(range(len(live))), size, time_in_training)
            return
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
                       tolerance=PROBE_TOLERANCE[self.task.precision], is_fatal=is_out_of_memory,
                       time_in_training=time_in_training)
        finally:
            self._restore_state(snapshot)

    def _times_in_training(self, live: list[int], size: int) -> bool:
        """Whether the candidates are timed on training's own steps
        (:meth:`RouteChoice.time_in_training`): where every candidate would
        train ``live`` the same way, in one group on the same stack (gathered
        or whole), and the next iteration has the steps to time each of them
        ``RouteChoice.repeats`` times (so the route is settled by its end). Not with
        the compiled route among them (it gathers only small groups, and its
        first calls compile), nor once memory has split the members into groups."""
        candidates = self._candidates()
        steps = self.task.steps_per_iteration(self.members[live[0]].config)
        return (size >= len(live) and "compiled" not in candidates
                and steps >= self.routing.repeats * (len(candidates) + 1))

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
        return take_rows(x, rows), take_rows(y, rows), False

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

    def _snapshot_state(self, rows: list[int] | None = None, to_host: bool = False) -> Snapshot:
        """Copies of every stack and optimizer tensor (of ``rows`` only, if
        given), for :meth:`_restore_state`.

        ``to_host``: an iteration's safety net must not itself take the device
        memory it guards; the route probe, which restores a dozen times, keeps
        its copies on the device.
        """
        return Snapshot(self.stack.snapshot(rows, to_host), self.optimizer.snapshot(rows, to_host))

    def _restore_state(self, snapshot: Snapshot) -> None:
        self.stack.restore(snapshot.stack)
        self.optimizer.restore(snapshot.optimizer)
