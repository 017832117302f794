"""The batched route (docs/design.md D8): a model whose forward provably keeps its members
apart runs on the whole stack as plain tensor ops, without ``torch.vmap``.

Why: on a CPU, vmap adds a fixed cost to every op it batches. Measured on the
2-core machine (torch 2.13, one thread, 8 members of a width-64 MLP, batch 64):
a ReLU on ``(8, 64, 64)`` took 4 us alone and about 40 us under vmap; a Linear
62 us as one ``baddbmm`` and 117 us under vmap; a whole forward and backward
1160 us under vmap against 594 us written as batched matmuls (one member alone:
195 us). A small MLP's fused step is mostly that fixed cost.

Which models: those whose ``forward`` ``torch.fx`` traces to a graph of

- ``nn.Linear`` (each member's rows meet only its own weight: one batched
  matmul over the stack, ``(K, N, in) @ (K, in, out)``),
- elementwise activations, as modules (:data:`ELEMENTWISE_MODULES`) or
  functions (:data:`ELEMENTWISE_FUNCTIONS`, :data:`ELEMENTWISE_METHODS`),
- the modules whose settings are lifted per member and that act on each
  element alone (``nn.Dropout``, ``nn.LeakyReLU``, ``nn.ELU``:
  ``configuration.stack_form``), each member at its own setting,
- arithmetic between such values or with Python numbers,

so every tensor in the forward is one per member with the member in dim 0,
and every op acts on each member's rows alone. Anything else (a flatten or a
reshape, a reduction, indexing, a parameter read directly, a convolution,
BatchNorm, channel dropout, data-dependent control flow, a hook) keeps the model on
vmap: :func:`batched_forward` says why. A model it accepts is still checked
by the route probe against each member's own step, and kept only if faster.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .configuration import is_lifted, stack_form

Tensors = dict[str, torch.Tensor]

# Modules that act on each element alone, with no parameters: the same on a
# (K, N, ...) stack as on each member's (N, ...). Exact types only: a subclass
# may override forward. Modules whose settings chorus_tune lifts per member
# (Dropout, LeakyReLU, ELU: chorus_tune/configuration.py) are not here: the
# template holds their lifted form, run through configuration.stack_form.
ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.Mish, nn.Softplus,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.SELU, nn.CELU, nn.Softsign, nn.Tanhshrink,
    nn.LogSigmoid,
)
ELEMENTWISE_FUNCTIONS: frozenset[Callable] = frozenset({
    torch.relu, F.relu, torch.relu_, F.relu_, F.relu6, torch.tanh, F.tanh, torch.sigmoid, F.sigmoid,
    F.gelu, F.silu, F.mish, F.softplus, F.hardtanh, F.hardswish, F.hardsigmoid, F.selu, F.celu,
    F.softsign, F.tanhshrink, F.logsigmoid, torch.exp, torch.abs, torch.neg, torch.square,
    torch.add, torch.sub, torch.mul, torch.div,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pos,
})
ELEMENTWISE_METHODS: frozenset[str] = frozenset({
    "relu", "relu_", "tanh", "sigmoid", "exp", "abs", "neg", "square",
    "add", "add_", "sub", "mul", "mul_", "div",
})
_SCALARS = (int, float, bool, str, type(None))


@dataclass
class BatchedEligibility:
    """Whether a template may run on the batched route: ``forward`` when it
    may (else ``None``), and ``why`` not, in words."""

    forward: "BatchedForward | None"
    why: str | None = None

    @property
    def eligible(self) -> bool:
        return self.forward is not None


class BatchedForward:
    """A traced forward, run on stacked parameters: ``(params, x) -> output``
    with ``x`` ``(K, N, ...)`` and every parameter ``(K, ...)``.

    Traced once per mode: a trace runs the Python of ``forward`` once, so a
    forward that reads ``self.training`` bakes in the mode it was traced in
    (one traced in train mode would then train its evaluation). The graph of
    the template's mode at call time runs."""

    def __init__(self, graphs: dict[bool, fx.Graph], template: nn.Module):
        modules = dict(template.named_modules())
        # Each node's op resolved once, not on every step (a fused step calls this).
        self._steps = {training: [(node, _op(node, modules)) for node in graph.nodes]
                       for training, graph in graphs.items()}
        self._template = template

    def __call__(self, params: Tensors, x: torch.Tensor, settings: Tensors) -> torch.Tensor:
        """``settings``: each lifted setting's ``(K,)`` values, by the stack's
        names (``"<module path>.<setting>"``)."""
        env: dict[fx.Node, Any] = {}

        def value(n: fx.Node) -> Any:
            return env[n]

        for node, op in self._steps[self._template.training]:
            if node.op == "placeholder":
                env[node] = x
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], value)
            else:
                env[node] = op(params, settings, fx.node.map_arg(node.args, value),
                               fx.node.map_arg(node.kwargs, value))
        raise AssertionError("a traced graph always ends in an output node")


def _op(node: fx.Node, modules: dict[str, nn.Module]) -> Callable[..., Any] | None:
    """What ``node`` computes on the stack, as ``op(params, settings, args, kwargs)``
    (``None`` for the graph's input and output)."""
    if node.op == "call_module":
        module, name = modules[node.target], node.target
        if type(module) is nn.Linear:
            return lambda params, settings, args, kwargs: batched_linear(
                args[0], params[f"{name}.weight"], params.get(f"{name}.bias"))
        lifted = stack_form(module)
        if lifted is not None:
            names, fn = lifted
            return lambda params, settings, args, kwargs: fn(args[0], *(settings[f"{name}.{n}"] for n in names))
        return lambda params, settings, args, kwargs: module(*args, **kwargs)
    if node.op == "call_function":
        return lambda params, settings, args, kwargs: node.target(*args, **kwargs)
    if node.op == "call_method":
        return lambda params, settings, args, kwargs: getattr(args[0], node.target)(*args[1:], **kwargs)
    return None


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each member's ``F.linear(x[k], weight[k], bias[k])``, as one batched
    matmul: ``x`` ``(K, ..., in)``, ``weight`` ``(K, out, in)``, ``bias`` ``(K, out)``."""
    rows = x.reshape(x.shape[0], -1, x.shape[-1])
    if torch.is_autocast_enabled(rows.device.type):
        # Autocast casts inside each op; _StackedLinear's backward would meet its
        # saved fp32 weight beside a bf16 gradient. Left to autograd here.
        out = _stacked_linear_forward(rows, weight, bias)
    else:
        out = _StackedLinear.apply(rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[1])


def _stacked_linear_forward(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Autograd's form, run under autocast (batched_linear says why); it differs from
    # _StackedLinear.forward in baddbmm's broadcast-bias copy, which that one avoids.
    if bias is None:
        return torch.bmm(rows, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), rows, weight.transpose(1, 2))


class _StackedLinear(torch.autograd.Function):
    """:func:`batched_linear` with its backward written out, so that each
    gradient comes out in its parameter's own layout.

    Why: autograd's backward of ``bmm(rows, weight.transpose(1, 2))`` computes
    the weight's gradient as ``(K, in, out)`` and hands back its transpose, which
    ``AccumulateGrad`` then copies into ``(K, out, in)``; and ``baddbmm`` first
    copies the bias, broadcast, into the whole output. On the 2-core CPU (torch
    2.13, one thread, 16 members of a width-64 MLP, batch 64) those two copies
    took about 280 us of a 2.5 ms step under the profiler; with this backward
    a whole fused iteration ran 1.05-1.30x faster (4 to 64 members, old and new
    alternated: docs/design.md D8). The same products, so the same values up
    to the order of each sum (``tests/test_batched.py``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        out = torch.bmm(rows, weight.transpose(1, 2))
        if bias is not None:
            out += bias.unsqueeze(1)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        wants_rows, wants_weight, wants_bias = ctx.needs_input_grad
        grad_rows = torch.bmm(grad, weight) if wants_rows else None
        grad_weight = torch.bmm(grad.transpose(1, 2), rows) if wants_weight else None
        grad_bias = grad.sum(1) if ctx.has_bias and wants_bias else None
        return grad_rows, grad_weight, grad_bias


def batched_forward(template: nn.Module) -> BatchedEligibility:
    """Trace ``template`` and accept it for the batched route only if every
    node of its forward keeps members apart (see the module)."""
    hooked = _hooks(template)
    if hooked is not None:
        return BatchedEligibility(None, hooked)
    modules = dict(template.named_modules())
    own = _own_weights(template)
    if own is not None:
        return BatchedEligibility(None, own)
    graphs: dict[bool, fx.Graph] = {}
    mode = template.training
    try:
        for training in (True, False):
            template.train(training)
            try:
                graphs[training] = _Tracer().trace(template)
            except Exception as exc:  # noqa: BLE001 - data-dependent control flow, untraceable code, ...
                return BatchedEligibility(None, f"torch.fx cannot trace its forward ({type(exc).__name__}: {exc})")
    finally:
        template.train(mode)
    for graph in graphs.values():
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            return BatchedEligibility(None, f"its forward takes {len(placeholders)} inputs, not one")
        for node in graph.nodes:
            why = _refusal(node, modules)
            if why is not None:
                return BatchedEligibility(None, why)
    return BatchedEligibility(BatchedForward(graphs, template))


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with the lifted modules as leaves: their forward is
    run by ``configuration.stack_form`` (or refused), not traced into."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_lifted(m) or super().is_leaf_module(m, module_qualified_name)


def _own_weights(template: nn.Module) -> str | None:
    """Why a Linear's weights are not its own entries of the stack: shared with
    another module (tied weights appear once, under one name) or computed by a
    parametrization (weight norm, ...), so the batched call, which reads
    ``<name>.weight`` off the stack, would not find them."""
    params = dict(template.named_parameters())
    for name, m in template.named_modules():
        if type(m) is not nn.Linear:
            continue
        for attr in ("weight", "bias"):
            if getattr(m, attr) is not None and f"{name}.{attr}" not in params:
                return (f"the {attr} of Linear {name!r} is not its own parameter "
                        "(tied to another module's, or computed by a parametrization)")
    return None


def _hooks(template: nn.Module) -> str | None:
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return "a global forward hook is registered (the batched route would not run it)"
    for name, m in template.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"module {name or type(m).__name__!r} has a forward hook (the batched route would not run it)"
    return None


def _refusal(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Why ``node`` may mix members (``None``: it keeps them apart)."""
    if node.op == "placeholder":
        return None
    if node.op == "output":
        return None if isinstance(node.args[0], fx.Node) else "its forward returns more than one tensor"
    if node.op == "get_attr":
        return f"its forward reads {node.target!r} directly (not through a module call)"
    if not all(isinstance(a, (fx.Node, *_SCALARS)) for a in (*node.args, *node.kwargs.values())):
        return f"{_describe(node)} takes an argument that is neither a tensor of the forward nor a number"
    if node.op == "call_module":
        kind = type(modules[node.target])
        if kind is nn.Linear or kind in ELEMENTWISE_MODULES or stack_form(modules[node.target]) is not None:
            return None
        shown = getattr(modules[node.target], "source_type", kind.__name__)  # a lifted module: the user's type
        return f"submodule {node.target!r} is a {shown}, which the batched route does not run"
    if node.op == "call_function" and node.target in ELEMENTWISE_FUNCTIONS:
        return None
    if node.op == "call_method" and node.target in ELEMENTWISE_METHODS:
        return None
    return f"{_describe(node)} is not known to keep members apart"


def _describe(node: fx.Node) -> str:
    if node.op == "call_function":
        return f"its forward's call to {getattr(node.target, '__name__', node.target)}"
    if node.op == "call_method":
        return f"its forward's .{node.target}()"
    return f"its forward's {node.op} {node.target!r}"
