import torch

from adaptdist.passes.combine_partial_sums import combine_partial_sums
from adaptdist.passes.propagate_placements import propagate_placements
from adaptdist.compiler.capture import capture
from adaptdist.models.llama import TP_PLAN
from adaptdist.passes.context import PassContext
from adaptdist import graph_meta as gmeta
from adaptdist.placement import Shard
from models import mlp, tiny_llama
from passutil import local_shard, simulate_plan
from reference import eager_sgd


def _needs_allreduce(gm):
    return sum(1 for n in gm.graph.nodes for t in gmeta.get_redistribute(n).values() if t[0].__class__.__name__ == "Replicate")


class _TwoRowParallel(torch.nn.Module):
    """y = x + x W1^T + x W2^T with W1, W2 row-parallel: (R + P1) + P2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Linear(8, 8, bias=False)
        self.w2 = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return x + self.w1(x) + self.w2(x)


def test_partial_terms_are_summed_before_the_replicated_accumulator():
    model = _TwoRowParallel()
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    cg = capture(model, batch, torch.nn.functional.mse_loss)
    pp = {"w1.weight": Shard(1), "w2.weight": Shard(1)}
    ctx = PassContext(2, 4, mesh_axis="tp", shard_batch=False, param_placements=pp)
    gm, _ = propagate_placements(cg.gm, ctx)
    before = _needs_allreduce(gm)
    gm, changed = combine_partial_sums(gm, ctx)
    gm, _ = propagate_placements(gm, ctx)
    assert changed and _needs_allreduce(gm) == before - 1
    progs, _, outs = simulate_plan(model, batch, torch.nn.functional.mse_loss, 2, {"w*.weight": "S(1)"})
    assert sum("all_reduce" in c for c in progs[0].collectives()) == 1  # one reduction of P1 + P2
    hist, _ = eager_sgd(model, [batch], torch.nn.functional.mse_loss, 0.1, 1)
    assert abs(float(outs[0][progs[0].loss_index]) - hist[0][0]) < 1e-6


def test_llama_tp_has_megatrons_activation_all_reduces_and_equals_eager():
    """Megatron's count: per layer 2 in forward (attention-out, MLP-out) and 2 in backward
    (into q/k/v and into the MLP), plus the vocabulary-parallel embedding's output and the
    gradient into the vocabulary-parallel output layer."""
    model, batch, loss_fn = tiny_llama(5, 8)
    progs, pp, outs = simulate_plan(model, batch, loss_fn, 2, TP_PLAN)
    activation = [c for c in progs[0].collectives() if c.endswith(f", {5 * 8 * 32})")]
    assert len(activation) == 4 * 2 + 2
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
