import torch
import torch.nn.functional as F

from adaptdist.passes.globalize_reductions import globalize_reductions
from adaptdist.passes.propagate_placements import propagate_placements
from models import mlp, tiny_gpt
from passutil import captured_with_ctx, simulate
from reference import eager_sgd

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_mean_over_batch_becomes_sum_over_global_count():
    cg, gm, ctx = captured_with_ctx(mlp(7, "manual_mean"), 3)
    propagate_placements(gm, ctx)
    assert aten.mean.dim in _targets(gm) or aten.mean.default in _targets(gm)
    gm, changed = globalize_reductions(gm, ctx)
    assert changed
    assert aten.mean.dim not in _targets(gm) and aten.mean.default not in _targets(gm)
    divs = [n for n in gm.graph.nodes if n.target == aten.div.Tensor and n.args[1] == 7.0]
    assert divs, "the mean must divide by the global batch size 7"


def test_nll_mean_uses_global_total_weight():
    cg, gm, ctx = captured_with_ctx(tiny_gpt(5, 8), 2)
    propagate_placements(gm, ctx)
    gm, changed = globalize_reductions(gm, ctx)
    assert changed
    fwd = next(n for n in gm.graph.nodes if n.target == aten.nll_loss_forward.default)
    assert fwd.args[3] == 2  # reduction=sum locally


def test_untouched_when_nothing_is_sharded():
    cg, gm, ctx = captured_with_ctx(mlp(7, "manual_mean"), 1)
    propagate_placements(gm, ctx)
    # world size 1 still shards (trivially); but a graph with no mean is unchanged
    cg2, gm2, ctx2 = captured_with_ctx(mlp(7, "sum"), 2)
    propagate_placements(gm2, ctx2)
    assert globalize_reductions(gm2, ctx2)[1] is False


def test_every_loss_form_equals_the_global_loss_on_uneven_shards():
    for kind, world in (("mean", 3), ("sum", 2), ("mse", 2), ("manual_mean", 4)):
        model, batch, loss_fn = mlp(7, kind)
        _, outs = simulate(model, batch, loss_fn, world)
        hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
        for r in range(world):
            assert abs(float(outs[r][0]) - hist[0][0]) < 1e-5, (kind, r)


def test_ignore_index_counts_globally():
    model, batch, loss_fn = tiny_gpt(5, 8)
    batch[1][:3] = -1  # rank 0's rows are mostly ignored: a per-rank mean would differ
    _, outs = simulate(model, batch, loss_fn, 2)
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    assert abs(float(outs[0][0]) - hist[0][0]) < 1e-5


def test_replicated_scores_with_a_sharded_target_still_average_globally():
    """A model whose output is replicated (no batch dim flows through it) meets the batch-sharded
    target inside the loss: the loss op is sharded by the target, so its mean must be global too."""
    import torch.nn as nn

    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = nn.Parameter(torch.randn(5))
            self.out = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.logits.expand(x.shape[0], 5) + 0 * x.sum(), self.out.expand(x.shape[0], 3)

    torch.manual_seed(0)
    for loss_fn in (lambda o, t: F.cross_entropy(o[0].detach() * 0 + o[0], t[:, 0].long()) + F.mse_loss(o[1], t),):
        model = Broadcast()
        batch = (torch.randn(7, 2), torch.randint(0, 3, (7, 3)).float())
        _, outs = simulate(model, batch, loss_fn, 2)
        hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
        for r in range(2):
            assert abs(float(outs[r][0]) - hist[0][0]) < 1e-5
