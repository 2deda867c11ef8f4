"""adaptdist/compiler/expert_batching.py: batched matmuls against stacked [E, ...] expert weights under the
backend's vmap over ranks keep the expert dim apart from the rank dim, so ``plan="ep"`` keeps the experts
sharded (tokens moved by all_to_all, no all_gather of an expert weight) and the automatic plan can shard
them on their expert dim. The numerics on real gloo ranks: tests/test_moe.py::test_backend_on_two_gloo_ranks_equals_eager.
"""

from __future__ import annotations

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
from adaptdist.compiler.expert_batching import rank_bmm
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.lowering_options import LoweringOptions
from adaptdist.models import moe
from adaptdist.placement import Shard
from moe_workers import gathered_params


@pytest.mark.parametrize("batched", ["a", "b", "both"])
def test_rank_bmm_equals_bmm_under_vmap_values_and_gradients(batched):
    g = torch.Generator().manual_seed(0)
    w, e, n, d, h = 3, 4, 5, 6, 7
    a = torch.randn(w if batched != "b" else 1, e, n, d, generator=g).squeeze(0).requires_grad_()
    b = torch.randn(w if batched != "a" else 1, e, d, h, generator=g).squeeze(0).requires_grad_()
    dims = (0 if batched != "b" else None, 0 if batched != "a" else None)
    grads = []
    for fn in (torch.bmm, rank_bmm):
        out = torch.vmap(fn, in_dims=dims)(a, b)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        grads.append((out.detach(), a.grad.clone(), b.grad.clone()))
        a.grad = b.grad = None
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _backend_capture(world: int = 2, **kw):
    """The backend's joint graph of ``moe.factory(4, **kw)`` for ``world`` ranks (rank 0's Dynamo graph)."""
    seen = {}

    def capture_only(gm, example_inputs):
        seen["captured"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), world)
        return gm.forward

    torch._dynamo.reset()
    model, (x, _), _ = moe.factory(4, **kw)
    torch.compile(model, backend=capture_only, dynamic=False)(x[:4 // world])
    torch._dynamo.reset()
    return seen["captured"]


def test_ep_plan_through_the_backend_keeps_the_experts_sharded():
    """The rank programs of ``plan="ep"`` hold half the experts each, move tokens by all_to_all, and no
    all_gather moves an expert weight (before: vmap folded ranks into experts and both were gathered)."""
    captured = _backend_capture()
    progs = lower(captured, resolve_plan(ManualPlan.parse("ep", moe), captured, 2, None),
                  LoweringOptions.from_mb(None, front_end="backend"))
    for p in progs.values():
        assert p.state_placements["moe.w_in"] == p.state_placements["moe.w_out"] == ["S(0)"]
        assert gathered_params(p) == []
        assert any("all_to_all" in c for c in p.collectives()), p.collectives()
        bmm = [n for n in p.graph_module.graph.nodes if n.target == torch.ops.aten.bmm.default]
        assert bmm and all(n.meta["val"].shape[0] == 2 for n in bmm)  # E/2 experts per rank, all tokens


def test_auto_plan_through_the_backend_shards_the_expert_dim():
    """As for ``adaptdist train`` (test_moe.test_auto_plan_chooses_expert_parallelism_and_equals_eager), the
    planner splits these experts on their expert dim (before: on their hidden dims, Megatron's way)."""
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster

    captured = _backend_capture(seq_len=8, d=64, hidden=256)
    pp = plan_auto(captured, FixedCluster.uniform([("h", 2)])).plan.param_placements
    assert pp.get("moe.w_in") == pp.get("moe.w_out") == (Shard(0),), pp


def test_backend_ep_on_a_model_file_without_ep_plan_says_what_to_pass():
    import adaptdist

    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend=adaptdist.backend(plan="ep"),
                             dynamic=False)
    with pytest.raises(Exception, match=r"(?s)plan='ep'.*EP_PLAN.*ManualPlan\.parse\('ep', model_module\)"):
        compiled(torch.randn(2, 4)).sum().backward()
    torch._dynamo.reset()
