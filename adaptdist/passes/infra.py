"""The pass infrastructure: the runner of a pipeline, its debug checks and dumps, and helpers several passes use.

:func:`run_pipeline` runs an ordered tuple of passes (``passes/pipeline.py``: ``PASSES``) over one graph:
per pass it skips it if ``LoweringOptions.disabled_passes`` names it, runs it, and, when it changed the
graph, does the tail once (dead-code elimination, ``lint``, ``recompile``: the passes themselves do not);
with ``LoweringOptions.dump_dir`` it writes the graph before and after with an op-count diff, and with
``LoweringOptions.debug`` it checks the invariants of ``passes/README.md`` after every pass
(:func:`check_invariants`). An exception that is not an :class:`~adaptdist.errors.AdaptdistError` becomes
an :class:`~adaptdist.errors.InternalError` naming the pass, with advice for the entry point in use.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import AdaptdistError, InternalError, UsageError
from ..lowering_options import LoweringOptions
from .context import PassContext

log = logging.getLogger("adaptdist.compiler")

Pass = Callable[[torch.fx.GraphModule, PassContext], tuple[torch.fx.GraphModule, bool]]

AXIS = 0  # passes see one mesh axis at a time: its placement is the first of a node's layout


def placement_of(node: torch.fx.Node):
    """The placement (or tuple of placements, for multi-output ops) of ``node`` on the pass's mesh axis.

    Raises:
        AssertionError: the node has no placement yet (a pass ran before propagation).
    """
    layout = gmeta.get_placements(node)
    if layout is None:
        raise AssertionError(f"node {node.name} has no placement yet")
    return layout[AXIS]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A structural copy of ``gm`` whose nodes keep (shallow copies of) their meta."""
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    g.output_node().meta.update(gm.graph.output_node().meta)
    new = torch.fx.GraphModule(gm, g)
    return new


def padded_shard_size(size: int, world_size: int) -> int:
    """Rows of the largest torch.chunk shard of ``size`` rows over ``world_size`` ranks: what every rank pads its
    shard to for a gather / scatter / all_to_all of equal blocks."""
    return -(-size // world_size) if size else 0


def padded_numel(pad: torch.fx.Node, largest_rows: int) -> int:
    """Elements of one rank's padded shard: the largest shard's rows times the other dims of ``pad``."""
    import math

    return largest_rows * math.prod(pad.meta["val"].shape[1:])


def finish(gm: torch.fx.GraphModule) -> None:
    """The tail after a pass changed the graph: drop dead nodes, lint, regenerate the code."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def pass_names(passes: Sequence[Pass]) -> list[str]:
    """The names of ``passes`` in order (a pass run twice appears twice)."""
    return [p.__name__ for p in passes]


def check_disabled(options: LoweringOptions, passes: Sequence[Pass]) -> None:
    """Raise UsageError unless every name in ``options.disabled_passes`` is one of ``passes``."""
    names = pass_names(passes)
    unknown = [n for n in options.disabled_passes if n not in names]
    if unknown:
        raise UsageError(f"LoweringOptions.disabled_passes names {', '.join(map(repr, unknown))}, not a pass of the "
                         f"pipeline; the passes are {', '.join(dict.fromkeys(names))}")


def _op_counts(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) if n.op == "call_function" else n.op for n in gm.graph.nodes)


def _op_diff(before: collections.Counter, after: collections.Counter) -> str:
    rows = []
    for op in sorted(set(before) | set(after)):
        d = after[op] - before[op]
        if d:
            rows.append(f"{d:+d} {op}")
    return "\n".join(rows) or "(no op-count change)"


def _snapshot(gm: torch.fx.GraphModule) -> tuple:
    phs = [(n.name, gmeta.get_fqn(n), gmeta.get_role(n)) for n in gm.graph.find_nodes(op="placeholder")]
    out = gm.graph.output_node()
    roles = list(out.meta.get(gmeta.OUTPUT_ROLES, []))
    return phs, roles, str(gm.graph)


def check_invariants(gm: torch.fx.GraphModule, before: tuple, changed: bool, name: str) -> None:
    """The invariants of ``passes/README.md`` a pass must keep, checked on ``gm`` after pass ``name``
    (``before``: :func:`_snapshot` of the graph it got): placeholders and output roles unchanged (2), every
    node with a fake value (3), no in-place op, and every collective waited before use (1), and an
    unchanged graph when the pass says so (4).

    Raises:
        InternalError: names the pass, the invariant and the node.
    """
    phs, roles, text = before
    now_phs, now_roles, now_text = _snapshot(gm)

    def fail(what: str) -> None:
        raise InternalError(f"pass {name} broke an invariant of passes/README.md: {what}. This is a bug in adaptdist, "
                            "not in your model: please report it")

    if not changed and now_text != text:
        fail("it returned changed=False but changed the graph (4)")
    if now_phs != phs:
        fail("the placeholders changed (2)")
    if roles and len(now_roles) != len(roles):
        fail(f"the output has {len(now_roles)} roles, it had {len(roles)} (2)")
    for n in gm.graph.nodes:
        if n.op in ("output", "get_attr"):
            continue
        if "val" not in n.meta and not (n.op == "call_function" and not n.users and _returns_nothing(n)):
            fail(f"node {n.name!r} has no meta['val'] (3)")
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable and compat.functional_collective_kind(n.target) is None:
            fail(f"node {n.name!r} is the in-place op {n.target} (1)")
        if compat.is_functional_collective(n.target):
            users = list(n.users)
            if users and not all(compat.functional_collective_kind(u.target) == "wait" for u in users):
                fail(f"collective {n.name!r} is used before its wait_tensor (1)")


def internal_error_advice(options: LoweringOptions, plan_name: str) -> str:
    """What an internal error tells the user to try, for the entry point in use (``options.front_end``) and plan."""
    if options.front_end == "backend":
        trace = "set logging.getLogger('adaptdist').setLevel(logging.DEBUG) for the traceback"
        other = "adaptdist.backend(plan='dp')"
    else:
        trace = "run with -v for the traceback"
        other = "--plan dp"
    advice = f"please report it ({trace})"
    if plan_name != "dp":
        advice += f"; {other} may avoid it"
    return advice


def run_pipeline(gm: torch.fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], options: LoweringOptions,
                 dump_dir: str | None = None, plan_name: str = "") -> torch.fx.GraphModule:
    """Run ``passes`` in order over ``gm`` (module docstring); ``dump_dir``: this graph's dump directory.

    Raises:
        UsageError: ``options.disabled_passes`` names no pass of ``passes``.
        AdaptdistError: what a pass raises (e.g. UnsupportedOpError).
        InternalError: any other failure of a pass, or (debug) a broken invariant.
    """
    check_disabled(options, passes)
    d = Path(dump_dir) if dump_dir else None
    if d is not None:
        d.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(passes):
        name = p.__name__
        if name in options.disabled_passes:
            log.debug("pass %s: disabled", name)
            continue
        before = _snapshot(gm) if options.debug else None
        counts = _op_counts(gm) if d is not None else None
        if d is not None:
            (d / f"{i:02d}_{name}.before.txt").write_text(str(gm.graph))
        t0 = time.perf_counter()
        try:
            gm, changed = p(gm, ctx)
            if changed:
                finish(gm)
        except AdaptdistError:
            raise
        except Exception as e:
            log.debug("pass %s failed", name, exc_info=True)
            raise InternalError(
                f"internal error in pass {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                f"This is a bug in adaptdist, not in your model: {internal_error_advice(options, plan_name)}"
            ) from e
        log.debug("pass %s: %.1f ms, changed=%s", name, 1e3 * (time.perf_counter() - t0), changed)
        if before is not None:
            check_invariants(gm, before, changed, name)
        if d is not None:
            (d / f"{i:02d}_{name}.after.txt").write_text(str(gm.graph))
            (d / f"{i:02d}_{name}.ops.txt").write_text(_op_diff(counts, _op_counts(gm)) + "\n")
    return gm


def _returns_nothing(node: torch.fx.Node) -> bool:
    """Whether ``node``'s op returns no tensor (``_assert_tensor_metadata``, ``_assert_scalar``: checks the
    exporter leaves in the graph), so it has no value to record."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.returns
