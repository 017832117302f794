"""The package's import graph: the core never imports ray, and no module imports itself back."""
from __future__ import annotations

import ast
import pathlib

import chorus_tune

PACKAGE = pathlib.Path(chorus_tune.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every chorus_tune module ``path`` imports, at any depth in the file
    (an import inside a function is still an edge: moving it there hides a
    circle, it does not remove one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("chorus_tune"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("chorus_tune"):
                continue
            for alias in node.names:  # `from . import x` names a module
                sub = f"{target}.{alias.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else target)
    return {m for m in found if m != name}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    # A package's __init__ is not an edge target that counts: importing
    # chorus_tune.tune.actors.pool runs the package inits on the way, and
    # ours only name lazy exports.
    return {name: {m for m in _imports(path) if m in modules and not (modules[m].name == "__init__.py")}
            for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_no_module_of_the_package_imports_itself_back():
    assert _circles(import_graph()) == []


def test_the_circle_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_memory_primitives_sit_below_both_the_bucket_and_the_capacity_fit():
    graph = import_graph()
    assert "chorus_tune.memory" in graph["chorus_tune.bucket_iteration"]  # the bucket's part that recovers
    assert "chorus_tune.memory" in graph["chorus_tune.capacity"]
    assert not {"chorus_tune.capacity"} & (graph["chorus_tune.bucket"] | graph["chorus_tune.bucket_iteration"])
    assert not {m for m in graph["chorus_tune.memory"] if m.startswith("chorus_tune")}


def test_the_core_never_imports_the_ray_layer():
    graph = import_graph()
    core = [m for m in graph if not m.startswith("chorus_tune.tune")]
    assert {m: sorted(t for t in graph[m] if t.startswith("chorus_tune.tune")) for m in core} == {m: [] for m in core}


# The Tune layer's floors, bottom up (docs/design.md "Layout"): a module imports only from its own
# floor or below. The adapters share the top floor, and among them only trial/ is imported (by
# search/ and schedulers/, which need ChorusTrainable), never the other way.
TUNE_FLOORS = [
    ("values",), ("rules",), ("observe",), ("actors",), ("client",), ("trial",), ("search", "schedulers"),
]


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["chorus_tune", "tune"] or len(parts) < 3:
        return None
    return next((i for i, names in enumerate(TUNE_FLOORS) if parts[2] in names), None)


def _imports_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if _floor(m) is not None and _floor(t) is not None and _floor(t) > _floor(m))


def test_every_module_of_the_tune_layer_is_on_a_floor():
    graph = import_graph()
    tune = [m for m in graph if m.startswith("chorus_tune.tune.")]
    assert [m for m in tune if _floor(m) is None] == []


def test_no_module_of_the_tune_layer_imports_from_a_floor_above_it():
    assert _imports_up(import_graph()) == []


def test_the_floor_check_sees_an_import_that_runs_back_up():
    graph = {"chorus_tune.tune.rules.members": {"chorus_tune.tune.actors.pool"}}
    assert _imports_up(graph) == [("chorus_tune.tune.rules.members", "chorus_tune.tune.actors.pool")]
