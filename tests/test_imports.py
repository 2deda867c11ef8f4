"""The module import graph of adaptdist: no cycle, and the layers import downwards only.

Every import counts -- at module level, inside a function, under ``TYPE_CHECKING`` -- read from the
source (AST), nothing is imported. ``from . import X`` of a submodule is an edge to that submodule;
``from . import name`` of an attribute is an edge to the package's ``__init__``.

The layers, lowest first (README: Layout): the data model (``adaptdist/*.py``: cluster, cluster_file,
mesh, placement, plan, program, strategy, graph_meta, annotations, model_spec, errors, ...), then
``passes``, ``cost_models``, ``runtime``, ``calibrate``, ``compiler``, and ``cli`` (the commands) on top;
each imports only the ones before it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "adaptdist"
LAYERS = ("passes", "cost_models", "runtime", "calibrate", "compiler", "cli")  # lowest first
# packages beside the data model that are neither data model nor layer: built-in models and data
# sources (user-level code, as a model file would be)
NEITHER = ("models", "data")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _closest_module(name: str, modules: dict[str, Path]) -> str:
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """Module name -> the adaptdist modules it imports (itself excluded)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "adaptdist" or alias.name.startswith("adaptdist."):
                        edges[mod].add(_closest_module(alias.name, modules))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != "adaptdist" and not source.startswith("adaptdist."):
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    edges[mod].add(full if full in modules else _closest_module(source, modules))
        edges[mod].discard(mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(module: str) -> str | None:
    """``compiler``, ``runtime``, ... for a layer's module; ``""`` for the data model; None otherwise."""
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package __init__
    if parts[1] in LAYERS:
        return parts[1]
    if parts[1] in NEITHER:
        return None
    return ""


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read(edges):
    # the checker sees the edges it must: a relative import, a function-level import, a submodule
    assert "adaptdist.errors" in edges["adaptdist.cluster"]
    assert "adaptdist.compiler.capture" in edges["adaptdist.cli.common"]  # inside resolve_plan
    assert "adaptdist.calibrate.hardware" in edges["adaptdist.calibrate.local"]  # `from . import hardware`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle(edges):
    assert cycles(edges) == []


def test_runtime_imports_nothing_from_the_compiler(edges):
    bad = sorted((m, t) for m, ts in edges.items() for t in ts if layer(m) == "runtime" and layer(t) == "compiler")
    assert bad == []


def test_cost_models_import_nothing_from_the_runtime(edges):
    bad = sorted((m, t) for m, ts in edges.items() for t in ts
                 if layer(m) == "cost_models" and layer(t) == "runtime")
    assert bad == []


def test_the_data_model_imports_no_layer_and_not_the_package(edges):
    data_model = [m for m in edges if layer(m) == ""]
    assert {"adaptdist.cluster", "adaptdist.cluster_file", "adaptdist.program", "adaptdist.mesh",
            "adaptdist.model_spec", "adaptdist.errors"} <= set(data_model)
    bad = sorted((m, t) for m in data_model for t in edges[m] if layer(t) or t == "adaptdist")
    assert bad == []


def test_nothing_below_the_commands_imports_them(edges):
    bad = sorted((m, t) for m, ts in edges.items() for t in ts if layer(t) == "cli" and layer(m) != "cli")
    assert bad == []


def test_each_layer_imports_only_the_layers_below_it(edges):
    rank = {"": -1, **{name: i for i, name in enumerate(LAYERS)}}
    bad = sorted((m, t) for m, ts in edges.items() for t in ts
                 if layer(m) is not None and layer(t) is not None and rank[layer(t)] > rank[layer(m)])
    assert bad == []


HELP_CHECK = """
import contextlib, io, sys
from adaptdist.cli import main
for argv in ([], *([c] for c in sys.argv[1:])):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert "torch" not in sys.modules, f"adaptdist {' '.join(argv)} --help imported torch"
print("ok")
"""


def test_help_imports_no_torch():
    """``adaptdist --help`` and ``adaptdist COMMAND --help`` answer without importing torch (seconds, tens of
    seconds on a loaded machine): every command's parser is built from torch-free modules (issue 14)."""
    import subprocess
    import sys

    commands = ["train", "plan", "compile", "run", "estimate", "explain", "cluster", "launch", "zoo"]
    done = subprocess.run([sys.executable, "-c", HELP_CHECK, *commands], capture_output=True, text=True, timeout=120,
                          cwd=ROOT.parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
