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
