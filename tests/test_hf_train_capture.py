"""Hugging Face models whose attention masks are built by transformers' masking_utils (LLaMA with sdpa, BERT
with a padding mask) through ``adaptdist train``'s capture: captured in a compile session (the traceable mask
path, no data-dependent shortcut), lowered with the mask following the batch split, on 2 simulated ranks:
every step's loss, each rank's gradient shards and the parameters after SGD equal single-process eager."""

import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face models need transformers (the test extras)")

from adaptdist.annotations import ManualPlan  # noqa: E402
from adaptdist.compiler.capture import capture  # noqa: E402
from adaptdist.compiler.planner import plan_auto  # noqa: E402
from adaptdist.cost_models.hardware import FixedCluster  # noqa: E402
from adaptdist.models import zoo  # noqa: E402
from test_capture_edge_cases import train_simulated  # noqa: E402


@pytest.mark.parametrize("name,plan", [("hf-llama", "dp"), ("hf-bert", "dp"), ("hf-bert", "fsdp"), ("hf-mistral", "auto")])
def test_hugging_face_masks_capture_and_keep_the_batch_split(name, plan):
    model, batch, loss_fn = zoo.get(name).build(4)
    if plan == "auto":  # the planner's choice (it ran attention on whole activations beside a batch-split mask)
        chosen = plan_auto(capture(model, batch, loss_fn), FixedCluster.uniform([("h", 2)])).plan
    else:
        chosen = ManualPlan.parse(plan)
    progs = train_simulated(model, batch, loss_fn, 2, chosen, steps=2, lr=0.1)
    gm = progs[0].module
    assert any("scaled_dot_product" in str(n.target) or "bmm" in str(n.target) for n in gm.graph.nodes)
    if name == "hf-llama":  # attention runs on this rank's rows: no float activation of the batch is gathered
        # (BERT gathers one gradient: its token-type ids, a [1, T] buffer expanded to the batch, stay replicated)
        # (the bool padding mask [B, T] is: transformers indexes it with arange(B))
        gathered = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
        assert all(n.meta["val"].dtype == torch.bool for n in gathered), [(n.name, n.meta["val"].dtype) for n in gathered]


def test_gpt_neox_rotary_broadcast_dim_is_never_split_over_dp():
    """GPT-NeoX's rotary cos/sin are [1, 1, T, D/H] (a size-1 broadcast batch dim): the planner on dp=2 must not
    shard that dim (a rank would hold an empty slice and the lowering would give up on the planner's strategies,
    departing with a warning). No strategy of the plan shards an input or output dim shorter than the axis; the
    plan lowers as planned (no departure) and trains like eager."""
    from adaptdist.mesh import Mesh
    from adaptdist.passes.sharding_rules import shape, tensor_args
    from adaptdist.placement import Shard

    model, batch, loss_fn = zoo.get("hf-gptneox").build(4)
    captured = capture(model, batch, loss_fn)
    chosen = plan_auto(captured, FixedCluster.uniform([("h", 2)]), mesh=Mesh.parse("dp=2")).plan
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    short = []
    for name, (st,) in chosen.node_strategies.items():
        if st is None or name not in nodes:
            continue
        fx = nodes[name]
        shapes = [shape(a) for _, a in tensor_args(fx)]
        for p, s in zip(st.inputs, shapes):
            if isinstance(p, Shard) and p.dim < len(s) and s[p.dim] < 2:
                short.append((name, st.text(), s))
    assert not short, short
    progs = train_simulated(model, batch, loss_fn, 2, chosen, steps=2, lr=0.1)
    assert progs[0].plan.lowered.departures == (), progs[0].plan.lowered.departures
