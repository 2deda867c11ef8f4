"""Helpers for pass tests: capture, run passes up to a point, simulate ranks."""

from __future__ import annotations

from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model, lower
from adaptdist.lowering_options import LoweringOptions
from adaptdist.passes.context import PassContext
from adaptdist.passes.infra import copy_graph_module
from adaptdist.runtime.simulate import simulate_ranks


def captured_with_ctx(factory_out, world_size, bucket_bytes=25 * 2**20):  # one bucket for the small test models
    model, batch, loss_fn = factory_out
    cg = capture(model, batch, loss_fn)
    ctx = PassContext(world_size=world_size, batch_size=cg.batch_size, bucket_bytes=bucket_bytes)
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
