"""Completion: unannotated parameters take the shard their uses ask for (a fixed point of sweeps)."""

import logging

import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.passes.complete_placements import complete_param_placements
from adaptdist.passes.context import PassContext
from adaptdist.placement import Replicate, Shard
from models import mlp
from passutil import simulate_mesh
from reference import eager_sgd


def test_the_bias_of_a_column_parallel_layer_is_sharded_like_its_output(caplog):
    model, batch, loss_fn = mlp(7)  # 12 -> 24 -> 5
    cg = capture(model, batch, loss_fn)
    ctx = PassContext(2, 7, mesh_axis="tp", shard_batch=False,
                      param_placements={"fc1.weight": Shard(0), "fc2.weight": Shard(1)})
    with caplog.at_level(logging.INFO, logger="adaptdist.passes"):
        got = complete_param_placements(cg.gm, ctx)
    assert got == {"fc1.weight": Shard(0), "fc2.weight": Shard(1), "fc1.bias": Shard(0)}
    assert "fc1.bias -> S(0)" in caplog.text
    # fc2.bias is added to a partial sum made replicated: nothing asks for a shard
    assert "fc2.bias" not in got


def test_an_explicit_replicate_is_kept():
    model, batch, loss_fn = mlp(7)
    cg = capture(model, batch, loss_fn)
    ctx = PassContext(2, 7, mesh_axis="tp", shard_batch=False, param_placements={
        "fc1.weight": Shard(0), "fc2.weight": Shard(1), "fc1.bias": Replicate()})
    assert "fc1.bias" not in complete_param_placements(cg.gm, ctx)


def test_completed_plan_runs_exactly_and_stores_the_bias_sharded():
    model, batch, loss_fn = mlp(7)
    plan = ManualPlan("tp", ("dp", "tp"), "dp", (("fc1.weight", ("R", "S(0)")), ("fc2.weight", ("R", "S(1)"))))
    progs, outs = simulate_mesh(model, batch, loss_fn, "dp=2,tp=3", plan)
    assert progs[0].state_placements["fc1.bias"] == ["R", "S(0)"]
    assert [progs[r].state["fc1.bias"].shape[0] for r in range(3)] == [8, 8, 8]
    (loss, grads), = eager_sgd(model, [batch], loss_fn, 0.1, 1)[0]
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5
        g = outs[r][p.output_roles.index("grad:fc1.bias")]
        tp = r % 3
        torch.testing.assert_close(g, grads["fc1.bias"][8 * tp:8 * tp + 8], atol=1e-5, rtol=1e-5)


def test_uses_that_disagree_keep_the_cheaper_storage():
    """The bias is added to a column-parallel output (wants S(0)) and softmaxed whole (wants R):
    storing it sharded would need an all_gather for the softmax, storing it whole only a free
    local slice, so by DTensor's cost estimate it stays replicated."""

    class TwoUses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(6, 8, bias=False)
            self.b = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            return (self.fc(x) + self.b) * torch.softmax(self.b, 0)

    batch = (torch.randn(4, 6), torch.randn(4, 8))
    cg = capture(TwoUses(), batch, torch.nn.functional.mse_loss)
    ctx = PassContext(2, 4, mesh_axis="tp", shard_batch=False, param_placements={"fc.weight": Shard(0)})
    assert complete_param_placements(cg.gm, ctx) == {"fc.weight": Shard(0)}


def test_fsdp_shards_another_dim_where_dim_0_has_fewer_rows_than_ranks():
    """ViT's class token [1, 1, D] and position embedding [1, N, D]: dim 0 would leave a rank an empty shard,
    so FSDP shards their largest dim that every rank shares in; a parameter with no such dim stays R."""
    shapes = {"cls_token": (1, 1, 8), "pos_embed": (1, 5, 8), "w": (6, 4), "gate": (1,), "few": (3, 2)}
    pl = ManualPlan.parse("fsdp").axis_placements(shapes, set(shapes), {"dp": 4})["dp"]
    assert pl == {"cls_token": Shard(2), "pos_embed": Shard(2), "w": Shard(0), "gate": Replicate(), "few": Replicate()}
    assert ManualPlan.parse("fsdp").axis_placements(shapes, set(shapes), {"dp": 2})["dp"]["few"] == Shard(0)
