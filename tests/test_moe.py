"""Mixture of experts (issue 14, part 3): a top-k router, experts as an nn.ModuleList or one stacked
``[E, d, h]`` weight, combined with ``scatter_add`` / ``index_add``; under dp, fsdp, the automatic plan and
expert parallelism (``--plan ep``: the stacked experts split on their expert dim, tokens moved by
all_to_all).

Numerics: every rank's program run for 3 SGD steps (all ranks simulated in one process) against
single-process eager PyTorch: loss, every rank's shard of every gradient and of the parameters after the
steps, to 1e-5. No rank gathers the batch (no all_gather of activations). A few real gloo runs, under
timeouts.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.mesh import lowering_order
from adaptdist.errors import CaptureError, UsageError
from adaptdist.mesh import Mesh
from adaptdist.models import moe
from adaptdist.runtime.simulate import simulate_ranks
from passutil import global_shard
from reference import eager_sgd

STEPS, LR, TOL = 3, 0.5, 1e-5


def _collectives(prog) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, input shape) of every collective in a rank's program."""
    out = []
    for n in prog.module.graph.nodes:
        t = str(n.target)
        if "_c10d_functional" in t and "wait" not in t:
            v = n.args[0].meta.get("val")
            out.append((t.split(".")[1], tuple(v.shape) if v is not None else ()))
    return out


def run_sgd(model, batch, loss_fn, plan, world: int, mesh_text: str | None = None, steps: int = STEPS):
    """Compile ``plan`` for ``world`` ranks, run ``steps`` SGD steps with every rank simulated and check loss,
    gradient shards and parameter shards against eager after every step; returns the programs."""
    progs = compile_model(model, batch, loss_fn, world, plan, mesh=mesh_text)
    p0 = progs[0]
    mesh = p0.plan.mesh_spec
    order = lowering_order(mesh, p0.plan.batch_axis)
    history, final = eager_sgd(model, [batch], loss_fn, LR, steps)
    for step, (loss, grads) in enumerate(history):
        ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
        outs = simulate_ranks([p.module for p in progs.values()], ins, mesh)
        for r, p in progs.items():
            assert float(outs[r][p.loss_index]) == pytest.approx(loss, abs=TOL), (r, step)
            for f in p.param_fqns:
                g = outs[r][p.output_roles.index(f"grad:{f}")]
                want = global_shard(grads[f], p.state_placements.get(f), mesh, r, order)
                torch.testing.assert_close(g, want, atol=TOL, rtol=TOL, msg=f"rank {r} step {step} grad {f}")
                p.state[f] = p.state[f] - LR * g
    for r, p in progs.items():
        for f in p.param_fqns:
            want = global_shard(final[f], p.state_placements.get(f), mesh, r, order)
            torch.testing.assert_close(p.state[f], want, atol=TOL, rtol=TOL, msg=f"rank {r} param {f}")
    return progs


FORMS = {
    "list-scatter_add": dict(experts="list", combine="scatter_add"),
    "list-index_add": dict(experts="list", combine="index_add"),
    "stacked-scatter_add": dict(experts="stacked", combine="scatter_add"),
    "stacked-index_add": dict(experts="stacked", combine="index_add"),
}


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("form", list(FORMS))
def test_forms_under_dp_and_fsdp_equal_eager_without_gathering_the_batch(form, plan):
    model, batch, loss_fn = moe.factory(4, **FORMS[form])
    progs = run_sgd(model, batch, loss_fn, ManualPlan.parse(plan), 2)
    for r, p in progs.items():
        calls = _collectives(p)
        if plan == "dp":  # the loss and one bucket of gradients: nothing else moves
            assert {k for k, _ in calls} == {"all_reduce"}, calls
        # FSDP gathers parameters (flat buckets, 1-D); no activation is ever gathered
        assert all(len(s) == 1 for k, s in calls if k == "all_gather_into_tensor"), calls


def test_expert_parallel_preset_moves_tokens_by_all_to_all_and_keeps_experts_sharded():
    """``--plan ep``: each rank holds E/2 experts; the expert gradients are computed where the experts live
    from every rank's tokens (never all-reduced, so not scaled by the ep degree)."""
    model, batch, loss_fn = moe.factory(4, **FORMS["stacked-scatter_add"])
    plan = ManualPlan.parse("ep", moe)
    assert plan.mesh_axes == ("ep",) and plan.batch_axis == "ep"
    progs = run_sgd(model, batch, loss_fn, plan, 2)
    p = progs[0]
    assert p.state_placements["moe.w_in"] == ["S(0)"] and tuple(p.state["moe.w_in"].shape) == (2, 16, 32)
    calls = _collectives(p)
    kinds = [k for k, _ in calls]
    assert "all_to_all_single" in kinds and "all_gather_into_tensor" not in kinds, calls
    # the one gradient all_reduce holds the replicated parameters only (not the experts' 2 x 2 x 16 x 32)
    n_replicated = sum(v.numel() for n, v in model.named_parameters() if not n.startswith("moe.w_"))
    assert max(s[0] for k, s in calls if k == "all_reduce" and s) == n_replicated, calls


def test_uneven_experts_per_rank_and_an_expert_without_tokens():
    """3 experts on 2 ranks (2 + 1, torch.chunk's split), and expert 2 never picked by the router (its
    gate's logit pushed down): its gradients are zero in eager and in every rank's program."""
    model, batch, loss_fn = moe.factory(4, n_experts=3, k=1, **FORMS["stacked-index_add"])
    with torch.no_grad():
        model.moe.router.gate.weight[2] = -50 * model.moe.router.gate.weight[:2].abs().sum(0)
        model.inp.weight.abs_()
        model.inp.bias.fill_(1.0)
    (_, grads), = eager_sgd(model, [batch], loss_fn, LR, 1)[0]
    assert grads["moe.w_in"][2].abs().max() == 0 and grads["moe.w_in"][:2].abs().max() > 0
    progs = run_sgd(model, batch, loss_fn, ManualPlan.parse("ep", moe), 2)
    assert [tuple(p.state["moe.w_in"].shape) for p in progs.values()] == [(2, 16, 32), (1, 16, 32)]


def test_no_gradient_through_masked_slots():
    """The router's gates that top-k did not pick get no gradient from the experts' outputs: with k = E
    every expert's weight gets a gradient, with k = 1 an expert no token picked gets exactly zero."""
    model, batch, loss_fn = moe.factory(2, seq_len=1, n_experts=4, k=1, **FORMS["list-scatter_add"])
    (_, grads), = eager_sgd(model, [batch], loss_fn, LR, 1)[0]
    with torch.no_grad():
        x = model.inp(batch[0]).reshape(2, -1)
        picked = set(model.moe.router(x)[1].flatten().tolist())
    for e in range(4):
        zero = grads[f"moe.experts.{e}.fc.weight"].abs().max() == 0
        assert zero == (e not in picked), (e, picked)
    run_sgd(model, batch, loss_fn, ManualPlan.parse("fsdp"), 2)


def test_auto_plan_equals_eager():
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster

    model, batch, loss_fn = moe.factory(4, **FORMS["stacked-scatter_add"])
    result = plan_auto(capture(model, batch, loss_fn), FixedCluster.uniform([("h", 2)]))
    run_sgd(model, batch, loss_fn, result.plan, 2)


def test_data_dependent_dispatch_is_refused_naming_the_construct():
    """Mixtral's loop (``torch.where(idx == e)`` per expert, then ``index_add_``) has token counts that depend on
    the data; capture refuses it naming the line and says what to write instead."""
    model, batch, loss_fn = moe.factory(4, experts="list", dispatch="where")
    with pytest.raises(CaptureError, match=r"(?s)torch\.where\(idx == e\).*data-dependent.*dispatch"):
        capture(model, batch, loss_fn)


def test_ep_preset_needs_ep_plan_globs():
    import types

    with pytest.raises(UsageError, match="EP_PLAN"):
        ManualPlan.parse("ep", types.ModuleType("no_ep_plan"))
