"""The planner on the command line: ``--plan auto`` (the default of train, plan and estimate) and
``adaptdist explain NODE``."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

MAX_LOWERED_RANKS = 16
"""``explain`` lowers the plan to show what the lowering did with the node only up to this many ranks."""


def add_parser(sub: Any, add_common: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """``adaptdist explain NODE [model] ...``."""
    p = sub.add_parser("explain", help="why the automatic plan gave one node (or parameter) its strategy",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("node", help="a node name of the joint graph (see node_placements in plan.json) or a parameter "
                                "name such as blocks.0.fc.weight")
    add_common(p)
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum"), default="adamw")
    p.add_argument("--data", metavar="FILE|DIR", help="as for plan: the data a model file that sizes its model "
                                                      "from the data (builtin:dlrm) reads")
    p.add_argument("--plan", choices=("auto", "pp"), default="auto",
                   help="pp: explain the node in the planner's pipeline plan (as train/compile --plan pp; --mesh "
                        "pp=2,dp=2 fixes the stage groups): which stage holds it and its stage's intra-stage decision")
    from .pipeline_flags import add_pipeline_flags

    add_pipeline_flags(p)
    return p


def cmd_explain(args: argparse.Namespace, cluster: Any) -> int:
    """Plan automatically and print the alternatives of ``args.node`` on each mesh axis, with the reason."""
    import torch

    from ..model_spec import ModelSpec
    from ..compiler.capture import capture
    from ..compiler.planner.explain import explain
    from ..compiler.planner.summary import print_summary, run_planner

    from ..console import report_console

    console = report_console()
    spec = ModelSpec.parse(args.model)
    torch.manual_seed(0)
    model, example, loss_fn = spec.build(args.batch_size, args.seq_len, data_path=getattr(args, "data", None))
    t0 = time.perf_counter()
    captured = capture(model, example, loss_fn)
    from ..compiler.expert_lists import expert_lines

    for line in expert_lines(captured.stacked, captured.notes):
        console.print(line)
    from ..compiler.planner.explain import find_node
    from ..compiler.planner.graph import build_planning_graph

    pg = build_planning_graph(captured, cluster)
    node = find_node(pg, args.node)  # a misspelt name fails before planning
    optimizer = args.optimizer.replace("-", "_")
    from .pipeline_flags import wants_pipeline

    if wants_pipeline(args):  # --plan pp, --mesh pp=..., --stage-ranks
        return _explain_pipeline(args, captured, cluster, pg, optimizer, console, t0)
    result = run_planner(captured, cluster, args.mesh, optimizer, console,
                         pipeline=True if getattr(args, "consider_pp", False) else None)
    print_summary(console, result, layers=False)
    console.print(f"(planned in {time.perf_counter() - t0:.1f} s)")
    from ..compiler.planner.stages import PipelineChoice

    if isinstance(result.pipeline, PipelineChoice) and result.plan.pipeline is not None:  # the pipeline won
        from ..compiler.planner.stage_explain import explain_in_stage

        _print_stage_explanation(console, explain_in_stage(captured, cluster, result.pipeline, args.node,
                                                           optimizer=optimizer, pg=pg), result.pipeline, args.node)
        return 0
    found = explain(result, args.node)
    if not found:
        console.print(f"{args.node}: no decision on any mesh axis (a single-rank mesh)")
    for ax in found:
        console.print(_alternatives_table(f"{args.node} on mesh axis {ax.axis} ({result.plan.mesh[ax.axis]} ranks): "
                                          f"decision {ax.decision}, {ax.members} node(s) sharing it", ax))
        console.print(f"why: {ax.reason}")
    if cluster.world_size <= MAX_LOWERED_RANKS:  # what the lowering made of the decision, beside it
        from ..compiler.lowering import compile_model
        from ..compiler.planner.explain import lowered_lines
        from ..lowering_options import LoweringOptions

        programs = compile_model(model, example, loss_fn, cluster.world_size, result.plan,
                                 LoweringOptions(replicate_fallback=bool(getattr(args, "replicate_fallback", False))),
                                 captured=captured)
        fqn = args.node if args.node != node else None
        for line in lowered_lines(programs[0].plan, node, fqn):
            console.print(line)
    return 0


def _explain_pipeline(args: argparse.Namespace, captured: Any, cluster: Any, pg: Any, optimizer: str, console: Any,
                      t0: float) -> int:
    """``explain --plan pp`` / ``--mesh pp=...``: the planner's pipeline plan as train and compile choose it
    (:func:`~adaptdist.compiler.pipeline_auto.choose_pipeline_plan`), then the node in its stage."""
    from rich.markup import escape

    from ..compiler.pipeline_auto import choose_pipeline_plan
    from ..compiler.planner.stage_explain import explain_in_stage

    decision = choose_pipeline_plan(captured, cluster, cluster.world_size, mesh=args.mesh,
                                    microbatches=args.microbatches, schedule=args.schedule, optimizer=optimizer,
                                    stage_ranks=args.stage_ranks)
    for line in decision.lines():
        console.print(escape(line))
    console.print(f"(planned in {time.perf_counter() - t0:.1f} s)")
    if decision.choice is None:
        console.print(escape(f"{args.node}: the layers were split evenly without the planner's stage costs "
                             f"({decision.note}); no intra-stage decision to explain"))
        return 0
    _print_stage_explanation(console, explain_in_stage(captured, cluster, decision.choice, args.node,
                                                       optimizer=optimizer, pg=pg), decision.choice, args.node)
    return 0


def _alternatives_table(title: str, ax: Any) -> Any:
    """A rich Table of one mesh axis' alternatives (an ``explain`` axis entry): times in ms, peak memory in MiB."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("strategy (inputs->outputs)", "compute ms", "resharding ms", "total ms", "peak MiB", ""):
        t.add_column(col)
    for a in ax.alternatives:
        t.add_row(a.strategy, f"{1e3 * a.compute_s:.4f}", f"{1e3 * a.reshard_s:.4f}", f"{1e3 * a.total_s:.4f}",
                  f"{a.memory_bytes / 2**20:,.2f}", "chosen" if a.chosen else ("" if a.allowed else "ruled out"))
    return t


def _print_stage_explanation(console: Any, ex: Any, choice: Any, name: str) -> None:
    """The stage holding the node, the stage-level choice and the node's intra-stage alternatives per axis."""
    from rich.markup import escape

    for line in ex.lines():
        console.print(escape(line))
    ran = sorted((x for x in choice.schedules if x.why_not is None), key=lambda x: x.step_s)
    others = ", ".join(f"{x.schedule} {1e3 * x.step_s:.3f} ms" for x in ran if x.schedule != choice.schedule)
    console.print(escape(f"the stage-level choice: schedule {choice.schedule}, {choice.microbatches} microbatches, "
                         f"predicted step {1e3 * choice.step_s:.3f} ms" + (f" (others: {others})" if others else "")
                         + f"; stage {ex.stage.index} per microbatch F {1e3 * ex.stage.forward_s:.3f} ms, B "
                           f"{1e3 * ex.stage.backward_s:.3f} ms, W {1e3 * ex.stage.weight_s:.3f} ms"))
    for ax in ex.axes:
        console.print(_alternatives_table(f"{name} on stage {ex.stage.index}'s mesh axis {ax.axis} "
                                          f"({ex.mesh[ax.axis]} ranks): decision {ax.decision}, {ax.members} "
                                          "node(s) sharing it", ax))
        console.print(escape(f"why: {ax.reason}"))
