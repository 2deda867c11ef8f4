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

import re
import warnings

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.mesh import lowering_order
from adaptdist.errors import CaptureError, UsageError
from adaptdist.models import moe
from adaptdist.placement import Shard
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
    stack = lambda d: {**d, **{s: torch.stack([d[m] for m in ms]) for s, ms in p0.stacked.items()}}  # noqa: E731
    final = stack(final)  # ModuleList experts are held stacked (compiler/expert_lists.py)
    for step, (loss, grads) in enumerate(history):
        grads = stack(grads)
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


@pytest.mark.parametrize("form,plan", [("list-scatter_add", "dp"), ("list-index_add", "dp"), ("list-index_add", "fsdp"),
                                       ("stacked-scatter_add", "dp"), ("stacked-scatter_add", "fsdp")])  # stacked-index_add: ep
def test_forms_under_dp_and_fsdp_equal_eager_without_gathering_the_batch(form, plan):
    model, batch, loss_fn = moe.factory(4, **FORMS[form])
    progs = run_sgd(model, batch, loss_fn, ManualPlan.parse(plan), 2)
    for r, p in progs.items():
        calls = _collectives(p)
        if plan == "dp":  # the loss and one bucket of gradients: nothing else moves
            assert {k for k, _ in calls} == {"all_reduce"}, calls
        # FSDP gathers parameters (flat buckets, 1-D); no activation is ever gathered
        assert all(len(s) == 1 for k, s in calls if k == "all_gather_into_tensor"), calls


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_preset_moves_tokens_by_all_to_all_and_keeps_experts_sharded(world):
    """``--plan ep``: each rank holds E/world experts; the expert gradients are computed where the experts
    live from every rank's tokens (never all-reduced, so not scaled by the ep degree)."""
    model, batch, loss_fn = moe.factory(4, **FORMS["stacked-scatter_add"])
    plan = ManualPlan.parse("ep", moe)
    assert plan.mesh_axes == ("ep",) and plan.batch_axis == "ep"
    progs = run_sgd(model, batch, loss_fn, plan, world)
    p = progs[0]
    assert p.state_placements["moe.w_in"] == ["S(0)"] and tuple(p.state["moe.w_in"].shape) == (4 // world, 16, 32)
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
    run_sgd(model, batch, loss_fn, ManualPlan.parse("fsdp"), 2, steps=1)


def test_auto_plan_chooses_expert_parallelism_and_equals_eager():
    """On 2 CPU ranks with experts this size, the planner keeps each rank to half the experts (their weights
    ``S(0)`` on the expert dim) rather than replicating them; the plan lowers and equals eager."""
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster

    model, batch, loss_fn = moe.factory(4, 8, d=64, hidden=256, **FORMS["stacked-scatter_add"])
    result = plan_auto(capture(model, batch, loss_fn), FixedCluster.uniform([("h", 2)]))
    pp = result.plan.param_placements
    assert pp.get("moe.w_in") == pp.get("moe.w_out") == (Shard(0),), (result.plan.mesh, pp)
    progs = run_sgd(model, batch, loss_fn, result.plan, 2)
    assert tuple(progs[0].state["moe.w_in"].shape) == (2, 64, 256)


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


def test_backend_refuses_data_dependent_dispatch_at_the_graph_break():
    """Through torch.compile the ``torch.where`` loop is a graph break on a dynamic-shape op; the backend
    refuses it there with the same advice, rather than failing later on a symbolic size."""
    import adaptdist

    model, (x, y), loss_fn = moe.factory(4, experts="list", dispatch="where")
    compiled = torch.compile(model, backend=adaptdist.backend(plan="dp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match=r"(?s)CaptureError.*depends on the data.*dense dispatch"):
            loss_fn(compiled(x), y).backward()
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_backend_on_two_gloo_ranks_equals_eager():
    """torch.compile(backend=adaptdist.backend(plan=...)) on 2 gloo ranks, each passing its rows: losses,
    full gradients and parameters after 3 SGD steps equal eager's (the mean of the ranks' losses).
    Under ``ep`` the stacked experts stay sharded on their expert dim (the capture's batched matmuls keep the
    rank dim out of the expert dim: adaptdist/compiler/expert_batching.py): tokens move by all_to_all and no
    all_gather moves an expert weight; 3 experts on 2 ranks, one that no token picks: its gradients exactly
    zero. ``plan="ep"`` reads moe.py's EP_PLAN (``ep-module``: ``ManualPlan.parse("ep", moe)``). ModuleList experts
    under ``ep`` (compiler/dynamo_expert_lists.py): each rank's expert parameters hold only its experts (4 on 2
    ranks: 2 + 2; 3 on 2: 2 + 1, the last never picked), gradients and parameters equal eager's under the user's
    names."""
    from adaptdist.runtime.launch import launch_local
    from moe_workers import moe_backend_worker, starve_last_expert

    cases = [dict(form=FORMS["stacked-scatter_add"], plan="ep", batch=4),
             dict(form=dict(FORMS["stacked-index_add"], n_experts=3, k=1), plan="ep-module", batch=4, dead_expert=True),
             dict(form=FORMS["list-index_add"], plan="auto", batch=4),
             dict(form=FORMS["list-index_add"], plan="ep", batch=4),
             dict(form=dict(FORMS["list-scatter_add"], n_experts=3, k=1), plan="ep", batch=4, dead_expert=True)]
    where = dict(form=dict(experts="list", dispatch="where"), plan="dp", batch=4)  # refused, with the advice
    results = launch_local(moe_backend_worker, (cases + [where], STEPS, LR), 2)
    for r in range(2):
        assert re.search(r"(?s)depends on the data.*dense dispatch", results[r][-1].get("error", "")), results[r][-1]
    for k, case in enumerate(cases):
        model, (x, y), loss_fn = moe.factory(case["batch"], **case["form"])
        if case.get("dead_expert"):
            starve_last_expert(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(STEPS):
            losses = [loss_fn(model(xr), yr) for xr, yr in zip(x.chunk(2), y.chunk(2))]
            (sum(losses) / 2).backward()
            for r in range(2):
                got = results[r][k]
                assert got["losses"][s] == pytest.approx(losses[r].item(), abs=TOL), (case, r, s)
                for n, p in model.named_parameters():
                    torch.testing.assert_close(got["grads"][s][n], p.grad, atol=TOL, rtol=0, msg=f"{case} {r} {s} {n}")
                if case.get("dead_expert"):  # no token reaches expert 2: exactly zero, in eager and here
                    eager = dict(model.named_parameters())
                    last = ([("moe.w_in", -1), ("moe.w_out", -1)] if case["form"]["experts"] == "stacked" else
                            [(n, slice(None)) for n in eager if n.startswith("moe.experts.2.")])
                    for n, i in last:
                        assert got["grads"][s][n][i].abs().max() == 0 == eager[n].grad[i].abs().max(), (n, s)
            opt.step()
            opt.zero_grad()
        for r in range(2):
            for n, p in model.named_parameters():
                torch.testing.assert_close(results[r][k]["params"][n], p.detach(), atol=TOL, rtol=0, msg=f"{case} {n}")
            got = results[r][k]
            if case["plan"].startswith("ep"):
                assert got["meshes"] == [{"ep": 2}], got["meshes"]
                assert got["gathered"] == [[]], got["gathered"]  # no all_gather moves an expert weight (nor any)
                assert any("all_to_all" in c for c in got["collectives"][0]), got["collectives"]
                if case["form"]["experts"] == "stacked":
                    assert got["placements"][[n for n, _ in model.named_parameters()].index("moe.w_in")]  # sharded
                else:  # each rank's expert parameters hold its experts only (torch.chunk's split), empty the others
                    e = case["form"].get("n_experts", 4)
                    mine = list(torch.arange(e).chunk(2)[r].tolist())
                    for n, shape in got["local_shapes"].items():
                        if n.startswith("moe.experts."):
                            full = list(dict(model.named_parameters())[n].shape)
                            held = int(n.split(".")[2]) in mine
                            assert shape == (full if held else [0] + full[1:]), (r, n, shape)
        assert not any("graph break" in w for w in results[0][k]["warnings"]), results[0][k]["warnings"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaptdist_train_ep_equals_eager(tmp_path):
    """``adaptdist train adaptdist/models/moe.py:factory --plan ep`` on 2 gloo ranks: the losses of 3 SGD steps
    equal single-process eager's, each rank's program moves tokens by all_to_all and gathers nothing."""
    import json
    from pathlib import Path

    from adaptdist.cli import main

    out = tmp_path / "run"
    model_file = Path(moe.__file__)
    assert main(["train", f"{model_file}:factory", "--plan", "ep", "--nproc", "2", "--steps", "3", "--batch-size", "4",
                 "--seq-len", "6", "--optimizer", "sgd", "--lr", str(LR), "--threads-per-rank", "1",
                 "--sample-bytes", "0", "--timeout-s", "60", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    model, batch, loss_fn = moe.factory(4, 6)
    history, _ = eager_sgd(model, [batch], loss_fn, LR, STEPS)
    assert summary["initial_loss"] == pytest.approx(history[0][0], abs=TOL)
    assert summary["final_loss"] == pytest.approx(history[-1][0], abs=TOL)  # the loss of the last step
    code = (out / "programs" / "rank0" / "program.py").read_text()
    assert "mesh ep=2" in code and "all_to_all" in code and "all_gather" not in code


def _index_add_node(self_target=None):
    """index_add(self [4, 6], 0, index [3], source [3, 6]); ``self`` made by ``self_target`` (zeros) or a placeholder."""
    import torch.fx

    g = torch.fx.Graph()
    if self_target is None:
        s = g.placeholder("s")
    else:
        s = g.call_function(self_target, ([4, 6],))
    s.meta["val"] = torch.empty(4, 6)
    i, src = g.placeholder("i"), g.placeholder("src")
    i.meta["val"], src.meta["val"] = torch.zeros(3, dtype=torch.long), torch.empty(3, 6)
    n = g.call_function(torch.ops.aten.index_add.default, (s, 0, i, src))
    n.meta["val"] = torch.empty(4, 6)
    return n, s, i, src


def test_index_add_rule_keeps_other_dims_sharded_and_sums_partials():
    from adaptdist.passes.sharding_rules import apply_rule
    from adaptdist.placement import Partial, Replicate

    R, P = Replicate(), Partial()

    def run(n, placements):
        pl = dict(zip([a for a in (n.args[0], n.args[2], n.args[3])], placements))
        return apply_rule(n, lambda a: pl.get(a, R))

    n, s, i, src = _index_add_node()
    res = run(n, [Shard(1), R, R])  # a shard of the other dim carries; the source is sliced to match
    assert res.out == Shard(1) and res.needs == {(3,): Shard(1)}
    res = run(n, [Shard(0), R, Shard(0)])  # along the indexed (sharded) dim: gather first
    assert res.out == R and set(res.needs) == {(0,), (3,)}
    assert run(n, [P, R, P]).out == P
    res = run(n, [R, R, P])  # a replicated self must not be added once per rank
    assert res.out == R and res.needs == {(3,): R}
    n, s, i, src = _index_add_node(torch.ops.aten.zeros.default)
    assert run(n, [R, R, P]).out == P  # into zeros: the Partial sum stays a Partial sum


class _IndexAlongBatch(torch.nn.Module):
    """index_add along the batch dim (a fixed permutation of the rows): its rows mix across ranks."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        return torch.zeros_like(h).index_add(0, torch.arange(h.shape[0] - 1, -1, -1), h)


def test_index_add_along_the_batch_gathers_and_equals_eager():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
    progs = run_sgd(_IndexAlongBatch(), (x, y), torch.nn.functional.mse_loss, ManualPlan.parse("dp"), 2)
    assert any(k == "all_gather_into_tensor" for k, _ in _collectives(progs[0]))


def test_ep_preset_on_module_list_experts_shards_the_stacked_list():
    """``--plan ep`` on ModuleList experts: EP_PLAN's stacked-weight globs match nothing here and are dropped; the
    list, captured stacked (compiler/expert_lists.py), is split on its expert dim (tests/test_expert_lists.py)."""
    from adaptdist.compiler.lowering import resolve_plan

    model, batch, loss_fn = moe.list_factory(4)
    plan = resolve_plan(ManualPlan.parse("ep", moe), capture(model, batch, loss_fn), 2)
    assert plan.param_placements["moe.experts.*.fc.weight"] == (Shard(0),) and "moe.w_in" not in plan.param_placements


def test_ep_preset_without_experts_names_the_glob():
    """A model with neither stacked experts nor a ModuleList of them: EP_PLAN's globs match nothing, and the error
    says so."""
    from adaptdist.compiler.lowering import resolve_plan

    model, batch, loss_fn = _IndexAlongBatch(), (torch.randn(4, 6), torch.randn(4, 6)), torch.nn.functional.mse_loss
    with pytest.raises(UsageError, match=r"'moe.w_in' matches no parameter"):
        resolve_plan(ManualPlan.parse("ep", moe), capture(model, batch, loss_fn), 2)


def test_scatter_add_rule_sums_partials_into_zeros():
    import torch.fx

    from adaptdist.passes.sharding_rules import apply_rule
    from adaptdist.placement import Partial, Replicate

    R, P = Replicate(), Partial()
    g = torch.fx.Graph()
    z = g.call_function(torch.ops.aten.zeros.default, ([4, 3],))
    i, src = g.placeholder("i"), g.placeholder("src")
    z.meta["val"], i.meta["val"], src.meta["val"] = torch.empty(4, 3), torch.zeros(4, 2, dtype=torch.long), torch.empty(4, 2)
    n = g.call_function(torch.ops.aten.scatter_add.default, (z, 1, i, src))
    n.meta["val"] = torch.empty(4, 3)
    pl = {z: R, i: R, src: P}
    assert apply_rule(n, lambda a: pl[a]).out == P
    pl = {z: Shard(0), i: Shard(0), src: Shard(0)}  # tokens split, experts (dim 1) whole
    assert apply_rule(n, lambda a: pl[a]).out == Shard(0)


def test_a_hugging_face_data_dependent_moe_is_told_its_static_experts_setting():
    """Hugging Face's Mixtral block built from a config runs its experts as a per-expert torch.where loop (the
    backend refuses it); its experts_implementation='batched_mm' has static shapes and lowers equal to eager under
    auto, dp, fsdp and ep (issue 14): the refusal says so for a graph break in transformers' code only."""
    from adaptdist.compiler.capture import data_dependent_message

    hf = data_dependent_message("The compiled model", "(after .../transformers/models/mixtral/modeling_mixtral.py:109)")
    assert "experts_implementation='batched_mm'" in hf and "dense dispatch" in hf
    assert "batched_mm" not in data_dependent_message("The compiled model", "(after model.py:12)")
