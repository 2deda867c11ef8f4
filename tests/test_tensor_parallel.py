"""Manual tensor-parallel plans on a 1-D mesh (Megatron column/row parallel), all ranks simulated.

Loss and every gradient (each rank's shard of it) equal single-process eager.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.errors import UsageError
from models import mlp
from passutil import local_shard, simulate_plan
from reference import eager_sgd

MEGATRON_MLP = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"}


def _check(model, batch, loss_fn, world, placements, **kw):
    progs, pp, outs = simulate_plan(model, batch, loss_fn, world, placements, **kw)
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    loss, grads = hist[0]
    p0 = progs[0]
    for r in range(world):
        assert abs(float(outs[r][p0.loss_index]) - loss) < 1e-5, r
        for f in p0.param_fqns:
            got = outs[r][p0.output_roles.index(f"grad:{f}")]
            want = local_shard(grads[f], pp.get(f), world, r)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {r} grad {f}")
    return progs


@pytest.mark.parametrize("world", [2, 3, 5])
def test_megatron_mlp_column_then_row(world):
    model, batch, loss_fn = mlp(7)  # hidden 24: over 5 ranks the shards are 5,5,5,5,4
    progs = _check(model, batch, loss_fn, world, MEGATRON_MLP)
    colls = progs[0].collectives()
    assert any("all_reduce" in c for c in colls)  # the row-parallel partial sum
    assert progs[world - 1].state["fc1.weight"].shape[0] == len(torch.arange(24).chunk(world)[-1])


@pytest.mark.parametrize("world", [2, 5])
def test_column_parallel_alone_all_gathers_the_replicated_weights_gradient(world):
    """fc2 stays replicated: its gradient comes out sharded on dim 1 (uneven over 5) and is all-gathered."""
    model, batch, loss_fn = mlp(7)
    progs = _check(model, batch, loss_fn, world, {"fc1.weight": "S(0)", "fc1.bias": "S(0)"})
    assert any("all_gather" in c for c in progs[0].collectives())


def test_row_parallel_linear_16_to_10_over_6_ranks():
    """A public report: shards 3,3,3,3,3,1 of the input features."""
    torch.manual_seed(0)
    model = nn.Linear(16, 10)
    batch = (torch.randn(4, 16), torch.randn(4, 10))
    progs = _check(model, batch, F.mse_loss, 6, {"weight": "S(1)"})
    assert [p.state["weight"].shape[1] for p in progs.values()] == [3, 3, 3, 3, 3, 1]


def test_world_size_one_is_eager():
    model, batch, loss_fn = mlp(7)
    progs = _check(model, batch, loss_fn, 1, MEGATRON_MLP)
    assert progs[0].collectives() == []


def test_annotation_errors_name_the_glob():
    model, batch, loss_fn = mlp(7)
    with pytest.raises(UsageError, match="nothing.*matches no parameter"):
        simulate_plan(model, batch, loss_fn, 2, {"nothing.*": "S(0)"})
    with pytest.raises(UsageError, match="shards dim 3"):
        simulate_plan(model, batch, loss_fn, 2, {"fc1.weight": "S(3)"})


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_like_sharded_parameters_with_a_split_batch(world):
    """Every weight sharded on dim 0 over the same axis that splits the batch: weights are
    all-gathered where used, gradients reduced back to their shard."""
    model, batch, loss_fn = mlp(7)
    plan = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(0)", "fc2.bias": "S(0)"}
    progs = _check(model, batch, loss_fn, world, plan, shard_batch=True)
    colls = progs[0].collectives()
    assert any("all_gather" in c for c in colls)
    assert progs[0].state["fc1.weight"].shape[0] < 24  # each rank stores only its shard


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_like_gpt_with_tied_embedding(world):
    """Every GPT parameter sharded on dim 0 (uneven over 3), batch of 5 split; the tied
    embedding/output weight is gathered once and its gradient reduce-scattered."""
    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(5, 8)
    progs = _check(model, batch, loss_fn, world, {"*": "S(0)"}, shard_batch=True)
    assert any("reduce_scatter" in c for c in progs[0].collectives())


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_gpt_attention_by_heads_and_mlp(world):
    """q, k, v column-parallel (by heads), attention-out and MLP-out row-parallel: exactly the
    two all_reduces per block in forward and two in backward; the vocabulary-parallel embedding
    adds the all_reduce of its output, its tied output head the all_reduce of the gradient into
    its input; the cross entropy over logits sharded by vocabulary never gathers them: it
    all-reduces per row the max and the sum of exponentials (forward) and the gradient's sum
    (backward), and the scalar loss."""
    from adaptdist.models.gpt import TP_PLAN
    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(4, 8, num_heads=4)
    progs = _check(model, batch, loss_fn, world, TP_PLAN)
    colls = progs[0].collectives()
    rows = 4 * 8
    assert sum(c.endswith(f", {rows * 32})") for c in colls) == 4 * 2 + 2, colls
    assert sum(c.endswith(f", {rows})") for c in colls) == 3 and sum(c.endswith(", 1)") for c in colls) == 1
    assert len(colls) == 4 * 2 + 2 + 3 + 1 and all("all_reduce" in c for c in colls)


class ViewedWeight(nn.Module):
    """Uses its [12, n] weight through view(-1, 6): a dim-1 shard cannot survive that view."""

    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(12, n))

    def forward(self, x):
        return x @ self.w.view(-1, 6)


@pytest.mark.parametrize("cols", [8, 9])  # over 4 ranks: shards 2,2,2,2 and 3,3,3,0 (one empty)
def test_view_of_a_dim1_shard_redistributes(cols):
    model = ViewedWeight(cols)
    batch = (torch.randn(3, 12 * cols // 6), torch.randn(3, 6))
    progs = _check(model, batch, F.mse_loss, 4, {"w": "S(1)"})
    assert any("all_gather" in c for c in progs[0].collectives())
    assert [p.state["w"].shape[1] for p in progs.values()] == [len(c) for c in torch.arange(cols).chunk(4)] + [0] * (4 - len(torch.arange(cols).chunk(4)))


def test_batch_statistics_gather_the_batch():
    """max/var over the batch dim: every rank gathers the batch rows and computes them whole."""

    class Stats(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return h - h.max(0).values + h.var(0)

    torch.manual_seed(0)
    model = Stats()
    batch = (torch.randn(5, 4), torch.randn(5, 4))
    _check(model, batch, F.mse_loss, 2, {}, shard_batch=True)


@pytest.mark.parametrize("plan,world,split_batch", [("dp", 2, True), ("fsdp", 3, True), ("tp", 2, False)])
def test_llama_rmsnorm_rotary_swiglu_gqa(plan, world, split_batch):
    """Our LLaMA-style model (4 query heads, 2 key/value heads) under each plan equals eager."""
    from adaptdist.models.llama import TP_PLAN
    from models import tiny_llama

    annotations = {"dp": {}, "fsdp": {"*": "S(0)"}, "tp": TP_PLAN}[plan]
    model, batch, loss_fn = tiny_llama(5, 8)
    _check(model, batch, loss_fn, world, annotations, shard_batch=split_batch)


@pytest.mark.parametrize("annotation", [
    {"blocks.*.fc_out.bias": "S(0)"},          # residual stream sharded on its features, then LayerNorm
    {"blocks.*.attn.q.weight": "S(1)"},        # row-parallel q alone
    {"blocks.*.fc_out.weight": "S(0)"},        # column-parallel MLP-out alone
])
def test_unusual_gpt_placements_equal_eager(annotation):
    """Placements a user may write that make LayerNorm (and its backward) meet a tensor sharded on
    the normalized dim: it is gathered first, and every gradient equals eager."""
    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(4, 8)
    _check(model, batch, loss_fn, 2, annotation)
