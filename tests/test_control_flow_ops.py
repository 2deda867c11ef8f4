"""torch.cond under a split batch (issue 14): refused with a typed error naming the op under dp and fsdp (was an
InternalError, KeyError 'val'); with the replicate fallback it runs whole on every rank, and the automatic plan
keeps the batch whole, both equal to eager (loss and every gradient, ranks simulated in one process)."""

import pytest
import torch
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.calibrate.local import local_cluster
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.planner import plan_auto
from adaptdist.errors import UnsupportedOpError
from adaptdist.lowering_options import LoweringOptions
from adaptdist.runtime.simulate import simulate_ranks
from reference import eager_sgd


class CondNet(torch.nn.Module):
    """A branch on a parameter (the same on every rank) with torch.cond, and one on the batch's mean (``on_data``:
    a value over the whole batch, which a rank's own rows do not give)."""

    def __init__(self, on_data: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.on_data = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), on_data

    def forward(self, x):
        h = self.a(x)
        pred = h.mean() > 0 if self.on_data else self.a.weight.sum() > 0
        h = torch.cond(pred, lambda t: t.relu() * 2, lambda t: t.tanh(), (h,))
        return self.b(h)


def _batch(rows: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=g) + 0.1, torch.randint(0, 4, (rows,), generator=g)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_cond_on_a_split_batch_is_refused_naming_the_op(plan):
    model, batch = CondNet(), _batch()
    with pytest.raises(UnsupportedOpError) as e:
        compile_model(model, batch, F.cross_entropy, 2, ManualPlan.parse(plan))
    text = str(e.value)
    assert "op cond at node 'cond'" in text and "torch.where(pred, a, b)" in text and "--replicate-fallback" in text
    assert "true_graph" not in text  # the branches are subgraphs, not inputs with shapes


def _assert_equal_eager(model, batch, programs):
    outs = simulate_ranks([p.module for p in programs.values()],
                          [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in programs.values()])
    (loss, grads), = eager_sgd(model, [batch], F.cross_entropy, 0.1, 1)[0]
    for r, p in programs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, r
        for f in p.param_fqns:
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")], grads[f], atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f}")


@pytest.mark.parametrize("on_data", [False, True])
def test_cond_with_the_replicate_fallback_equals_eager(on_data):
    """The fallback gathers the cond's inputs, the predicate included: every rank takes the branch one process
    takes on the whole batch, even where the predicate depends on the data."""
    model, batch = CondNet(on_data), _batch()
    programs = compile_model(model, batch, F.cross_entropy, 2, ManualPlan.parse("dp"),
                             LoweringOptions(replicate_fallback=True))
    _assert_equal_eager(model, batch, programs)


def test_the_automatic_plan_of_a_cond_model_equals_eager():
    model, batch = CondNet(), _batch()
    plan = plan_auto(capture(model, batch, F.cross_entropy), local_cluster(2)).plan
    _assert_equal_eager(model, batch, compile_model(model, batch, F.cross_entropy, 2, plan))
