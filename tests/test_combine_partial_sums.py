import torch

from adaptdist.passes.combine_partial_sums import combine_partial_sums
from adaptdist.passes.decompose_addmm import decompose_addmm
from adaptdist.passes.propagate_placements import propagate_placements
from adaptdist.annotations import resolve_param_placements
from adaptdist.compiler.capture import capture
from adaptdist.models.llama import TP_PLAN
from adaptdist.passes.context import PassContext
from adaptdist import graph_meta as gmeta
from models import mlp, tiny_llama
from passutil import local_shard, simulate_plan
from reference import eager_sgd


def _needs_allreduce(gm):
    return sum(1 for n in gm.graph.nodes for t in gmeta.get_redistribute(n).values() if t[0].__class__.__name__ == "Replicate")


def test_partial_terms_are_summed_before_the_replicated_accumulator():
    model, batch, loss_fn = tiny_llama(5, 8)
    cg = capture(model, batch, loss_fn)
    named = dict(model.named_parameters())
    pp = resolve_param_placements({f: tuple(named[f].shape) for f in cg.param_fqns}, TP_PLAN)
    ctx = PassContext(2, 5, mesh_axis="tp", shard_batch=False, param_placements=pp)
    gm, _ = decompose_addmm(cg.gm, ctx)
    gm, _ = propagate_placements(gm, ctx)
    before = _needs_allreduce(gm)
    gm, changed = combine_partial_sums(gm, ctx)
    gm, _ = propagate_placements(gm, ctx)
    assert changed and _needs_allreduce(gm) < before


def test_llama_tp_has_four_activation_all_reduces_per_layer_and_equals_eager():
    model, batch, loss_fn = tiny_llama(5, 8)
    progs, pp, outs = simulate_plan(model, batch, loss_fn, 2, TP_PLAN)
    activation = [c for c in progs[0].collectives() if c.endswith(f", {5 * 8 * 32})")]
    assert len(activation) == 4 * 2
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    p0 = progs[0]
    for r in range(2):
        for f in p0.param_fqns:
            torch.testing.assert_close(outs[r][p0.output_roles.index(f"grad:{f}")],
                                       local_shard(hist[0][1][f], pp.get(f), 2, r), atol=1e-5, rtol=1e-5)


def test_untouched_without_partial_terms():
    model, batch, loss_fn = mlp(7)
    cg = capture(model, batch, loss_fn)
    ctx = PassContext(1, 7)
    gm, _ = propagate_placements(cg.gm, ctx)
    assert combine_partial_sums(gm, ctx)[1] is False
