"""Which route a bucket's fused step takes, and why (docs/design.md D8).

A bucket asked for ``route="auto"`` runs one training step of its members on a
probe batch through each candidate route (``"vmap"``; ``"batched"`` too for a
model chorus_tune/batched.py accepts, ``"compiled"`` when the task asks for
``compile=True``) and through the per-member eager loop,
which is always correct. A candidate whose result disagrees with the eager
loop, or that raises, is rejected; of the routes left, the fastest is kept.

The candidates that agree are timed on training's own first steps where the
bucket can run them so (:meth:`RouteChoice.time_in_training`: each step one
route's, interleaved), else on the probe batch (:func:`time_routes`).

This module holds the decision: the reasons (:class:`RouteReason`), the
per-member verdict (:func:`judge`), the timing (:func:`time_routes`, and the
step timings a :class:`RouteChoice` collects), the math mode the comparison
runs in (:func:`same_math_mode`), and the record of the choice
(:class:`RouteChoice`). Running a probe step is the bucket's job; it hands
this module a function that does it.
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

ROUTES = ("auto", "vmap", "compiled", "batched", "eager")
TIMING_REPEATS = 5

# How far a candidate may disagree with the eager loop on the probe and still
# count as the same computation, per precision. float32: batched and unbatched
# matmuls sum in different orders (~1e-7 relative). bfloat16 keeps 8 bits of
# mantissa (~4e-3 relative per rounding): batched and unbatched kernels round
# at different points: measured on the CPU, up to 2.6e-3 relative beyond the
# atol on the probe's losses and updated state (a CNN under Adam), 0 for an
# MLP. A real mismatch (a member whose forward reads its own
# attributes) is off by the size of the activations, far beyond either.
PROBE_TOLERANCE = {"fp32": (1e-3, 1e-5), "bf16": (5e-2, 1e-3)}


class RouteReason(enum.Enum):
    """Why a bucket runs the route it runs. The value is what results report
    (``chorus/route_reason``); :attr:`description` says it in words."""

    REQUESTED = "requested"
    UNDECIDED = "undecided"
    TIMING = "timing"
    FASTER = "faster"
    DISAGREES = "disagrees"
    VMAP_FAILED = "vmap_failed"
    COMPILE_FAILED = "compile_failed"
    COMPILE_DISAGREES = "compile_disagrees"
    BATCHED_FAILED = "batched_failed"
    BATCHED_DISAGREES = "batched_disagrees"
    PROBE_OUT_OF_MEMORY = "probe_out_of_memory"
    PADDING_DISAGREES = "padding_disagrees"
    SOLO = "solo"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    RouteReason.REQUESTED: "the route was asked for: not probed",
    RouteReason.UNDECIDED: "not probed yet (the first iteration probes)",
    RouteReason.TIMING: "every candidate agreed with the per-member loop on the probe; training's first steps "
                        "time them (each step one route's) and the fastest stays",
    RouteReason.FASTER: "every candidate agreed with the per-member loop on the probe; this one was the fastest",
    RouteReason.DISAGREES: "vmap disagreed with the per-member loop on the probe batch: eager (always correct)",
    RouteReason.VMAP_FAILED: "vmap raised an error on the probe batch: eager (always correct)",
    RouteReason.COMPILE_FAILED: "torch.compile of the fused step raised an error on the probe: not compiled",
    RouteReason.COMPILE_DISAGREES: "the compiled fused step disagreed with the per-member loop on the probe: "
                                   "not compiled",
    RouteReason.BATCHED_FAILED: "the batched step (chorus_tune/batched.py) raised an error on the probe: vmap",
    RouteReason.BATCHED_DISAGREES: "the batched step (chorus_tune/batched.py) disagreed with the per-member loop "
                                   "on the probe: vmap",
    RouteReason.PROBE_OUT_OF_MEMORY: "the route probe ran out of memory even one member at a time: "
                                     "eager (always correct)",
    RouteReason.PADDING_DISAGREES: "a member padded to the bucket's widths disagreed with its own model (the "
                                   "padding check, docs/design.md D9): eager, each member its own model "
                                   "(always correct)",
    RouteReason.SOLO: "a member alone, trained in its trial's process: its own module and the stock "
                      "torch.optim optimizer, unfused (docs/design.md D2)",
}

# The reason a rejected candidate gives, by how it was rejected.
_REJECTED = {
    ("vmap", "disagrees"): RouteReason.DISAGREES, ("vmap", "failed"): RouteReason.VMAP_FAILED,
    ("compiled", "disagrees"): RouteReason.COMPILE_DISAGREES, ("compiled", "failed"): RouteReason.COMPILE_FAILED,
    ("batched", "disagrees"): RouteReason.BATCHED_DISAGREES, ("batched", "failed"): RouteReason.BATCHED_FAILED,
    ("vmap", "padding"): RouteReason.PADDING_DISAGREES,
}


@dataclass
class ProbeResult:
    """One probe step's outcome, one row per probed member: their losses
    ``(n,)`` and their rows of every state tensor afterwards ``(n, ...)``."""

    losses: torch.Tensor
    state: list[torch.Tensor]


@dataclass
class Verdict:
    """How a candidate compared with the eager loop, member by member.

    ``compared``: members finite on both routes, held to the tolerance.
    ``nonfinite``: members non-finite on either route: their divergence is
    their own (a config that blows up, NaN data), not the route's, and judging
    the route on them would demote their bucket-mates to the slow route.
    ``disagreeing``: compared members outside the tolerance.
    """

    compared: list[int]
    nonfinite: list[int]
    disagreeing: list[int]

    @property
    def agrees(self) -> bool:
        return not self.disagreeing


def _rows_finite(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    return torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)


def _rows_close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    if not a.is_floating_point():
        return (a == b).reshape(a.shape[0], -1).all(dim=1)
    a, b = a.float(), b.float()
    return torch.isclose(a, b, rtol=rtol, atol=atol).reshape(a.shape[0], -1).all(dim=1)


def judge(members: list[int], eager: ProbeResult, other: ProbeResult, rtol: float, atol: float) -> Verdict:
    """Compare ``other`` with ``eager`` member by member (row i is ``members[i]``)."""
    pairs = [(eager.losses, other.losses), *zip(eager.state, other.state)]
    finite = torch.ones(len(members), dtype=torch.bool, device=eager.losses.device)
    close = finite.clone()
    for a, b in pairs:
        finite &= _rows_finite(a) & _rows_finite(b)
        close &= _rows_close(a, b, rtol, atol)
    finite_rows, close_rows = finite.tolist(), close.tolist()
    return Verdict(
        compared=[m for m, f in zip(members, finite_rows) if f],
        nonfinite=[m for m, f in zip(members, finite_rows) if not f],
        disagreeing=[m for m, f, c in zip(members, finite_rows, close_rows) if f and not c],
    )


@contextlib.contextmanager
def same_math_mode() -> Iterator[None]:
    """Full float32 for both cuDNN convolutions and matmuls while the probe compares.

    By default cuDNN convolutions use TF32 (~1e-3 relative) and matmuls do
    not, and a vmap'd convolution may run as a matmul or a grouped
    convolution: under the default modes the two routes would differ by the
    precision mode, not by what they compute. Timing runs in the user's modes
    (what training will use). No effect on a CPU.
    """
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def time_routes(step: Callable[[str], None], routes: list[str], sync: Callable[[], None],
                reset: Callable[[], None] = lambda: None, repeats: int = TIMING_REPEATS) -> dict[str, float]:
    """Best-of-``repeats`` seconds of ``step(route)`` for each route, interleaved
    (a single timing of each route picked the slow one on a loaded 2-core
    machine). ``reset()``, untimed, puts the state back after each step: the
    put-back costs every route alike, and timed it hid their difference
    (a copy of every state tensor, about as long as the step itself)."""
    best = {route: float("inf") for route in routes}
    for _ in range(repeats):
        for route in routes:
            sync()
            start = time.perf_counter()
            step(route)
            sync()
            best[route] = min(best[route], time.perf_counter() - start)
            reset()
    return best


@dataclass
class RouteChoice:
    """The route a bucket runs, why, and what the probe saw.

    ``route`` is ``None`` until the first probe when ``requested == "auto"``.
    ``seconds``: the probe's best step time per route (empty until timed).
    ``rejected``: each candidate the probe rejected, with its reason and the
    error or the disagreeing members. ``nonfinite``: members left out of the
    comparison because they were non-finite (see :class:`Verdict`).
    """

    requested: str
    route: str | None = None
    reason: RouteReason = RouteReason.UNDECIDED
    seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, tuple[RouteReason, str]] = field(default_factory=dict)
    nonfinite: list[int] = field(default_factory=list)
    checked: bool = False  # the current members were probed (a newcomer unsets it)
    # While training's own steps time the candidates (time_in_training): route ->
    # the seconds of each of its steps so far; empty otherwise.
    step_times: dict[str, list[float]] = field(default_factory=dict)
    repeats: int = TIMING_REPEATS

    def __post_init__(self) -> None:
        if self.requested not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}; got {self.requested!r}")
        if self.requested != "auto":
            self.route, self.reason, self.checked = self.requested, RouteReason.REQUESTED, True

    @property
    def timed(self) -> bool:
        return bool(self.seconds)

    def needs_probe(self) -> bool:
        """Whether the members must be probed before the next iteration.

        Once a candidate was rejected, eager stays: the members that broke it
        are still here or may return. Once eager was timed faster, eager stays
        too: it is correct for any newcomer.
        """
        return not self.checked and self.route != "eager"

    @property
    def timing(self) -> bool:
        """Whether training's next steps time the candidates (:meth:`step_route`)."""
        return bool(self.step_times)

    def time_in_training(self, routes: list[str]) -> None:
        """Every route in ``routes`` agreed with eager on the probe: time them
        on training's own next steps rather than on repeated probe steps. The
        probe's timing steps were put back after each and bought nothing;
        these train (measured on the 2-core CPU: the first iteration of 16
        two-hidden-layer members took 0.80 s with the probe's timing, against
        0.39 s for the next, about half of it the timing). Until every route has
        ``repeats`` steps the bucket runs :meth:`step_route`'s route each step."""
        self.step_times = {route: [] for route in routes}
        # Meanwhile the route is the first's (a fused candidate's, so the bucket
        # trains as a fused route would), and the first step is the first's.
        self.settle(routes[0], RouteReason.TIMING)

    def step_route(self) -> str:
        """The route of training's next step while timing: the one timed least
        so far (interleaved, in order: the load of a shared machine falls on
        every route alike)."""
        return min(self.step_times, key=lambda route: len(self.step_times[route]))

    def record_step(self, route: str, seconds: float) -> None:
        """One training step of ``route`` took ``seconds``; once every route
        has ``repeats``, the fastest (best of each) is kept."""
        if route not in self.step_times:
            return
        self.step_times[route].append(seconds)
        if all(len(times) >= self.repeats for times in self.step_times.values()):
            self.seconds = {route: min(times) for route, times in self.step_times.items()}
            self.step_times = {}
            route = min(self.seconds, key=self.seconds.get)
            self.settle(route, _reason_for(route, self.rejected))

    def forget_timing(self) -> None:
        """The step costs something else now (a wider stack): time it again."""
        self.seconds, self.step_times = {}, {}

    def member_joined(self) -> None:
        """A newcomer may not be vmap-compatible with the rest: probe again."""
        if self.requested == "auto":
            self.checked = False

    def reject(self, route: str, how: str, detail: str) -> RouteReason:
        reason = _REJECTED[(route, how)]
        self.rejected[route] = (reason, detail)
        return reason

    def settle(self, route: str, reason: RouteReason) -> None:
        self.route, self.reason, self.checked = route, reason, True

    def report(self) -> dict[str, Any]:
        """A plain dict for results and logs."""
        return {
            "route": self.route,
            "reason": self.reason.value,
            "description": self.reason.description,
            "requested": self.requested,
            "seconds": dict(self.seconds),
            "rejected": {route: {"reason": reason.value, "detail": detail}
                         for route, (reason, detail) in self.rejected.items()},
            "nonfinite_members": list(self.nonfinite),
        }


def decide(choice: RouteChoice, candidates: list[str], groups: list[list[int]],
           probe: Callable[[str, list[int]], ProbeResult], reset: Callable[[], None],
           sync: Callable[[], None], tolerance: tuple[float, float], is_fatal: Callable[[BaseException], bool],
           time_in_training: bool = False) -> None:
    """Probe ``candidates`` against eager on each group of members, then time
    the survivors (once per bucket) and record the choice in ``choice``.
    ``time_in_training``: the bucket can run training's own steps on any of
    them, so the survivors are timed there (:meth:`RouteChoice.time_in_training`)
    rather than here.

    ``probe(route, members)`` runs one training step and returns its
    :class:`ProbeResult`; ``reset()`` puts the state back as the probe found
    it. An exception for which ``is_fatal`` is true (running out of memory:
    that says nothing about the route) propagates; any other from a
    candidate rejects it.
    """
    rtol, atol = tolerance
    surviving = list(candidates)
    nonfinite: set[int] = set()
    for group in groups:
        with same_math_mode():
            eager = probe("eager", group)
            reset()
            for route in list(surviving):
                try:
                    result = probe(route, group)
                except Exception as exc:  # an op without a batching rule, data-dependent control flow, ...
                    if is_fatal(exc):
                        raise
                    choice.reject(route, "failed", f"{type(exc).__name__}: {exc}")
                    surviving.remove(route)
                    continue
                finally:
                    reset()
                verdict = judge(group, eager, result, rtol, atol)
                nonfinite.update(verdict.nonfinite)
                if not verdict.agrees:
                    choice.reject(route, "disagrees", f"members {verdict.disagreeing} outside rtol={rtol}, "
                                                      f"atol={atol}")
                    surviving.remove(route)
    choice.nonfinite = sorted(nonfinite)
    if not choice.timed and surviving and time_in_training:
        choice.time_in_training([*surviving, "eager"])
        return
    choice.step_times = {}
    if not choice.timed and surviving:
        choice.seconds = time_routes(lambda route: probe(route, groups[0]), ["eager", *surviving], sync, reset)
    if choice.timed:
        timed = {r: s for r, s in choice.seconds.items() if r == "eager" or r in surviving}
        route = min(timed, key=timed.get)
    else:
        route = surviving[0] if surviving else "eager"  # re-probed after timing: the same winner, or eager
    choice.settle(route, _reason_for(route, choice.rejected))


def _reason_for(route: str, rejected: dict[str, tuple[RouteReason, str]]) -> RouteReason:
    # Why no better route runs: eager because vmap was rejected (then no
    # fused route can run); vmap because compiling was rejected; else speed.
    if route == "eager" and "vmap" in rejected:
        return rejected["vmap"][0]
    if route == "vmap" and "compiled" in rejected:
        return rejected["compiled"][0]
    if route == "vmap" and "batched" in rejected:
        return rejected["batched"][0]
    return RouteReason.FASTER
