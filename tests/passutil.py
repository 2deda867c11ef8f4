"""Helpers for pass tests: capture, run passes up to a point, simulate ranks."""

from __future__ import annotations

from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model, lower
from adaptdist.lowering_options import LoweringOptions
from adaptdist.passes.context import PassContext
from adaptdist.passes.infra import copy_graph_module
from adaptdist.runtime.simulate import simulate_ranks


def captured_with_ctx(factory_out, world_size, bucket_bytes=25 * 2**20):  # one bucket for the small test models
    model, batch, loss_fn = factory_out
    cg = capture(model, batch, loss_fn)
    ctx = PassContext(axis_size=world_size, batch_size=cg.batch_size, bucket_bytes=bucket_bytes)
    return cg, copy_graph_module(cg.gm), ctx


def _options(kw):
    """LoweringOptions from the old keyword arguments of the tests (bucket_bytes, dump_dir, replicate_fallback)."""
    if "options" in kw:
        return kw.pop("options")
    if "bucket_bytes" in kw:
        kw["grad_bucket_bytes"] = kw.pop("bucket_bytes")
    return LoweringOptions(**kw)


def lower_1d(cg, world_size, *, mesh_axis="dp", shard_batch=True, param_placements=None, state=None, options=None,
             node_strategies=None):
    """Lower ``cg`` onto a 1-D mesh ``mesh_axis`` of ``world_size`` ranks: the batch split (``shard_batch``),
    parameters placed as ``param_placements`` ({fqn: Placement}), ``node_strategies`` ({node: Strategy}) as a
    planner's."""
    from adaptdist.plan import Plan, graph_fingerprint

    plan = Plan(mesh={mesh_axis: world_size}, batch_axis=mesh_axis if shard_batch else None,
                param_placements={f: (p,) for f, p in (param_placements or {}).items()},
                graph_fingerprint=graph_fingerprint(cg.gm), name="test",
                node_strategies={n: (s,) for n, s in (node_strategies or {}).items()})
    return lower(cg, plan, options or LoweringOptions(), state=state)


def simulate(model, batch, loss_fn, world_size, **kw):
    """Compile DP programs and run all ranks in one process; returns (programs, outputs per rank)."""
    progs = compile_model(model, batch, loss_fn, world_size, None, _options(kw))
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
    return progs, simulate_ranks([p.module for p in progs.values()], ins)


def simulate_plan(model, batch, loss_fn, world_size, placements, shard_batch=False, **kw):
    """Lower with manual parameter placements (globs) on a 1-D mesh and run all ranks in one process."""
    from adaptdist.annotations import resolve_param_placements
    cg = capture(model, batch, loss_fn)
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    shapes = {f: tuple(named[f].shape) for f in cg.input_fqns}
    pp = resolve_param_placements(shapes, placements)
    state = {f: named[f].detach() for f in cg.input_fqns}
    progs = lower_1d(cg, world_size, mesh_axis="tp", shard_batch=shard_batch, param_placements=pp, state=state,
                     options=_options(kw))
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
    # the placements the programs store, completion included (e.g. the bias of a column-parallel layer)
    from adaptdist.placement import parse_placement

    stored = {f: parse_placement(v[0]) for f, v in progs[0].state_placements.items()}
    return progs, stored, simulate_ranks([p.module for p in progs.values()], ins)


def local_shard(t, placement, world_size, rank):
    from adaptdist.placement import Shard, chunk_interval

    if not isinstance(placement, Shard):
        return t
    s, e = chunk_interval(t.shape[placement.dim], world_size, rank)
    return t.narrow(placement.dim, s, e - s)


def simulate_mesh(model, batch, loss_fn, mesh_text, plan_text, **kw):
    """Compile a (possibly multi-axis) manual plan on mesh ``mesh_text`` (e.g. ``"dp=2,tp=2"``) and run
    every rank in one process with collectives on the mesh's groups; returns (programs, outputs)."""
    import adaptdist.models.gpt as gpt_module
    from adaptdist.annotations import ManualPlan
    from adaptdist.mesh import Mesh

    mesh = Mesh.parse(mesh_text)
    plan = plan_text if not isinstance(plan_text, str) else ManualPlan.parse(plan_text, kw.pop("model_module", gpt_module))
    progs = compile_model(model, batch, loss_fn, mesh.world_size, plan, _options(kw), mesh=mesh_text)
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
    return progs, simulate_ranks([p.module for p in progs.values()], ins, mesh)


def global_shard(t, placements, mesh, rank, order):
    """Rank ``rank``'s piece of global tensor ``t`` under per-axis ``placements`` (texts, mesh order),
    chunked along the axes in lowering ``order``."""
    from adaptdist.placement import Shard, chunk_interval, parse_placement

    coords = dict(zip(mesh.names, mesh.coords(rank)))
    pls = dict(zip(mesh.names, [parse_placement(p) for p in placements])) if placements else {}
    for axis in order:
        p = pls.get(axis)
        if isinstance(p, Shard) and mesh.size(axis) > 1:
            s, e = chunk_interval(t.shape[p.dim], mesh.size(axis), coords[axis])
            t = t.narrow(p.dim, s, e - s)
    return t


def apply_pass(pass_, gm, ctx):
    """Run one pass through its signature ``(gm, ctx) -> (gm, changed)``, then the tail a pass runner does
    (dead code, lint, recompile), so a test sees the same graph whether the pass or the runner does it."""
    gm, changed = pass_(gm, ctx)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm, changed


def pipeline():
    """The lowering passes in pipeline order (passes/README.md's table), as (name, pass) pairs."""
    from adaptdist.passes.bucket_grad_allreduce import bucket_grad_allreduce
    from adaptdist.passes.bucket_grad_reduce_scatter import bucket_grad_reduce_scatter
    from adaptdist.passes.bucket_param_allgather import bucket_param_allgather
    from adaptdist.passes.combine_partial_sums import combine_partial_sums
    from adaptdist.passes.decompose_addmm import decompose_addmm
    from adaptdist.passes.globalize_reductions import globalize_reductions
    from adaptdist.passes.insert_redistributes import insert_redistributes
    from adaptdist.passes.propagate_placements import propagate_placements
    from adaptdist.passes.regather_in_backward import regather_in_backward
    from adaptdist.passes.relax_views import relax_views
    from adaptdist.passes.vocab_parallel_embedding import vocab_parallel_embedding
    from adaptdist.passes.vocab_parallel_loss import vocab_parallel_loss

    return [(p.__name__, p) for p in (
        decompose_addmm, propagate_placements, combine_partial_sums, globalize_reductions, propagate_placements,
        insert_redistributes, vocab_parallel_embedding, vocab_parallel_loss, regather_in_backward,
        bucket_param_allgather, bucket_grad_reduce_scatter, bucket_grad_allreduce, relax_views)]


def lowered_until(factory_out, world_size, placements=None, stop_before="", **ctx_fields):
    """Capture, complete ``placements`` ({fqn: Placement}, None: none sharded) on a 1-D ``dp`` axis and run the
    pipeline up to (not including) the pass named ``stop_before`` ("" : all of it); returns (captured, gm, ctx)
    with ``ctx`` holding the completed placements and ``ctx_fields`` (e.g. ``bucket_bytes``)."""
    import dataclasses

    from adaptdist.passes.complete_placements import complete_param_placements

    cg, gm, ctx = captured_with_ctx(factory_out, world_size)
    ctx = dataclasses.replace(ctx, param_placements=dict(placements or {}), **ctx_fields)
    ctx = dataclasses.replace(ctx, param_placements=complete_param_placements(gm, ctx))
    for name, p in pipeline():
        if name == stop_before:
            break
        gm, _ = apply_pass(p, gm, ctx)
    return cg, gm, ctx


def fsdp_placements(model):
    """Every parameter with a dim sharded on dim 0 (the fsdp preset's placements)."""
    from adaptdist.placement import Shard

    return {f: Shard(0) for f, p in model.named_parameters() if p.dim() >= 1}


def collective_nodes(gm, kind):
    """The nodes of ``gm`` marked as collective ``kind`` (``"all_gather"``, ``"reduce_scatter"``, ...)."""
    from adaptdist import graph_meta as gmeta

    return [n for n in gm.graph.nodes if gmeta.get_collective(n) == kind]


def check_mesh_against_eager(model, batch, loss_fn, mesh_text, plan, **kw):
    """Lower ``plan`` on ``mesh_text``, run every rank in one process and assert each rank's loss and its
    shard of every gradient equal single-process eager (1e-5); returns the programs."""
    import torch

    from adaptdist.mesh import Mesh
    from reference import eager_sgd

    progs, outs = simulate_mesh(model, batch, loss_fn, mesh_text, plan, **kw)
    (loss, grads), = eager_sgd(model, [batch], loss_fn, 0.1, 1)[0]
    mesh = Mesh.parse(mesh_text)
    batch_axis = progs[0].plan.batch_axis
    order = [a for a in mesh.names if a != batch_axis] + ([batch_axis] if batch_axis in mesh.names else [])
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, (r, float(outs[r][p.loss_index]), loss)
        for f in p.param_fqns:
            want = global_shard(grads[f], p.state_placements.get(f), mesh, r, order)
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")], want, atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f}")
    return progs


def assert_untouched(pass_, gm, ctx):
    """Run ``pass_`` where it does not apply: it must say so (``changed=False``) and leave the graph's text as it
    was. Returns the graph."""
    text = str(gm.graph)
    gm, changed = pass_(gm, ctx)
    assert not changed and str(gm.graph) == text, f"{pass_.__name__} changed a graph it does not apply to"
    return gm


def loss_position(gm):
    """Index in program order of the node computing the loss (before the all_reduce/wait that replicate it)."""
    out = gm.graph.output_node()
    n = out.args[0][gmeta.get_output_roles(out).index("loss")]
    while gmeta.get_collective(n) in ("wait", "all_reduce"):
        n = n.args[0]
    return list(gm.graph.nodes).index(n)


def simulated_sgd(model, batch, loss_fn, world: int, plan: str, lr: float, steps: int, **options):
    """``steps`` SGD steps (``lr``) of ``adaptdist train``'s programs for ``plan`` (``"auto"``: the planner on
    the local cluster of ``world`` ranks; another string: a preset; else a plan already made) with
    ``LoweringOptions(**options)``, every rank run in this process, each updating its shards with its gradient
    outputs and taking its ``buffer:`` outputs.

    Returns ``(progs, history, params, buffers)``: per step ``(loss, {fqn: full gradient})`` (every rank must
    hold the same loss), the full parameters after the steps, and ``{fqn: [each rank's buffer]}``."""
    import copy

    import torch

    from adaptdist.annotations import ManualPlan

    model = copy.deepcopy(model)
    cg = capture(model, batch, loss_fn)
    if not isinstance(plan, str):  # a plan already made (e.g. by plan_auto on a cluster of the test's own)
        resolved = plan
    elif plan == "auto":
        from adaptdist.calibrate.local import local_cluster
        from adaptdist.compiler.planner import plan_auto

        resolved = plan_auto(cg, local_cluster(world), replicate_fallback=options.get("replicate_fallback", False)).plan
    else:
        resolved = ManualPlan.parse(plan)
    progs = compile_model(model, batch, loss_fn, world, resolved, LoweringOptions(**options), captured=cg)

    def full(fqn, per_rank):
        pl = progs[0].state_placements.get(fqn)
        if not pl or pl[0] == "R":
            return per_rank[0]
        return torch.cat([per_rank[r] for r in sorted(per_rank)], int(pl[0][2:-1]))

    state = {r: dict(p.state) for r, p in progs.items()}
    history = []
    for _ in range(steps):
        ins = [[state[r][f] for f in p.input_fqns] + list(p.local_batch(batch)) for r, p in progs.items()]
        outs = simulate_ranks([p.module for p in progs.values()], ins)
        roles = progs[0].output_roles
        grads: dict[str, dict[int, torch.Tensor]] = {}
        for r in progs:
            for role, v in zip(roles, outs[r]):
                if role.startswith("buffer:"):
                    state[r][role[7:]] = v
                elif role.startswith("grad:"):
                    grads.setdefault(role[5:], {})[r] = v
                    state[r][role[5:]] = state[r][role[5:]] - lr * v
        losses = {float(outs[r][roles.index("loss")]) for r in progs}
        assert len(losses) == 1, losses  # every rank holds the loss
        history.append((losses.pop(), {f: full(f, g) for f, g in grads.items()}))
    params = {f: full(f, {r: state[r][f] for r in progs}) for f in progs[0].param_fqns}
    buffers = {f: [state[r][f] for r in progs] for f in progs[0].input_fqns if f not in progs[0].param_fqns}
    return progs, history, params, buffers


def assert_sgd_equal(history, params, want_history, want_params, tol: float = 1e-5):
    """:func:`simulated_sgd`'s ``history`` and ``params`` equal eager's (``reference.eager_sgd``) to ``tol``: every
    step's loss and gradients, and the parameters after the steps."""
    import torch

    assert len(history) == len(want_history)
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(history, want_history)):
        assert abs(loss - want_loss) < tol, (step, loss, want_loss)
        for f in want_grads:
            torch.testing.assert_close(grads[f], want_grads[f], atol=tol, rtol=tol, msg=f"step {step} grad {f}")
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=tol, rtol=tol, msg=f"param {f}")
