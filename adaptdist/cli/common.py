"""What several commands share: turning ``--plan`` into a plan object."""

from __future__ import annotations


def resolve_plan(args, spec, model, example, loss_fn, cluster, console, optimizer: str, layers: bool = True):
    """``--plan`` as a plan object, and the captured step when the planner captured it (else None):
    ``auto`` runs the planner for ``cluster`` (printing its summary), anything else is a manual plan."""
    from ..annotations import ManualPlan

    if args.plan != "auto":
        return ManualPlan.parse(args.plan, spec.module()), None
    from ..compiler.capture import capture
    from ..compiler.planner.summary import print_summary, run_planner

    captured = capture(model, example, loss_fn)
    result = run_planner(captured, cluster, args.mesh, optimizer, console,
                         replicate_fallback=bool(getattr(args, "replicate_fallback", False)))
    print_summary(console, result, layers=layers)
    return result.plan, captured

