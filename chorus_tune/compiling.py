"""``torch.compile`` of the vmap'd fused call, with its compilations counted and bounded.

The compiled route (``Task(compile=True)``, docs/design.md D8) is the vmap
route under ``torch.compile``; the route probe checks it against the eager
loop like any route. The forward and the loss are compiled (AOTAutograd
compiles their backward with them); the optimizer step is not.

Each member count compiles its own graph (``dynamic=False``). Why: under
``torch.vmap`` dynamo specialises the vmapped dimension, so marking the member
dimension dynamic fails ("you marked ... as dynamic but your code specialized
it to be a constant", torch 2.13, measured on the CPU), and without marking it
the automatic dynamic shapes would specialise it again. Member counts change
rarely: refill fills a masked slot (no change), compaction halves the stack,
and a group gathered after an out-of-memory error halves too. So a bucket
compiles O(log K) graphs; measured on the 2-core CPU, 25-30 s each for a
width-64 MLP. Past :data:`MAX_MEMBER_COUNTS` counts the call runs uncompiled
(plain vmap, the same numbers) rather than compile again, and says so.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

MAX_MEMBER_COUNTS = 4


class CompileUnavailable(RuntimeError):
    """torch.compile ran but compiled nothing (dynamo fell back to eager)."""


class CompiledCalls:
    """The compiled versions of a stack's vmap'd calls.

    ``compiles``: graphs compiled so far (a recompile adds one).
    ``uncompiled_calls``: calls run as plain vmap because their member count
    was past the bound, or because dynamo declined to compile them.
    """

    def __init__(self, max_member_counts: int = MAX_MEMBER_COUNTS):
        self.max_member_counts = max_member_counts
        self.compiles = 0
        self.uncompiled_calls = 0
        self._calls: dict[tuple[Callable, bool], Callable] = {}
        self._counts: dict[tuple[Callable, bool], set[int]] = {}

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.compiles += 1
        return lookup_backend("inductor")(graph, example_inputs)

    def call(self, vmapped: Callable[[Callable, bool], Callable], fn: Callable, shared: bool,
             params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             x: torch.Tensor, y: torch.Tensor) -> Any:
        """``vmapped(fn, shared)(params, buffers, x, y)``, compiled.

        Raises :class:`CompileUnavailable` if the very first call compiled
        nothing (dynamo's recompile limit, or a frame it skips): the route
        would be plain vmap then while calling itself compiled.
        """
        key = (fn, shared)
        count = next(iter(params.values())).shape[0]
        seen = self._counts.setdefault(key, set())
        if count not in seen and len(seen) >= self.max_member_counts:
            self.uncompiled_calls += 1
            return vmapped(fn, shared)(params, buffers, x, y)
        compiled = self._calls.get(key)
        if compiled is None:
            def fused(p: dict, b: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
                return vmapped(fn, shared)(p, b, xb, yb)

            compiled = self._calls[key] = torch.compile(fused, backend=self._backend, dynamic=False)
        before = self.compiles
        out = compiled(params, buffers, x, y)
        if count not in seen:
            seen.add(count)
            if self.compiles == before:
                if len(seen) == 1:
                    del self._calls[key], self._counts[key]
                    raise CompileUnavailable("torch.compile compiled nothing for the fused call "
                                             "(dynamo ran it uncompiled)")
                self.uncompiled_calls += 1
        return out
