import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture
from adaptdist.errors import UnsupportedOpError
from adaptdist.passes.context import PassContext
from adaptdist.passes.propagate_placements import placement_of, propagate_placements
from adaptdist.placement import Partial, Replicate, Shard
from models import convnet, mlp
from passutil import captured_with_ctx


def test_batch_sharded_params_replicated_weight_grads_partial():
    cg, gm, ctx = captured_with_ctx(mlp(), 2)
    gm, changed = propagate_placements(gm, ctx)
    assert changed
    for ph in gm.graph.find_nodes(op="placeholder"):
        want = Shard(0) if gmeta.get_role(ph) == "batch" else Replicate()
        assert placement_of(ph) == want
    out = gm.graph.output_node()
    roles = gmeta.get_output_roles(out)
    for o, role in zip(out.args[0], roles):
        if role.startswith("grad:"):
            assert placement_of(o) == Partial()
    # the loss is a partial value and must be made replicated
    assert gmeta.get_redistribute(out) == {(0, roles.index("loss")): (Replicate(),)}
    # running it again changes nothing: annotations are a fixed point
    assert propagate_placements(gm, ctx)[1] is False


def test_training_batch_norm_is_refused_and_eval_is_fine():
    model, batch, loss_fn = convnet(4, batch_norm=True)
    cg = capture(model, batch, loss_fn)
    with pytest.raises(UnsupportedOpError, match="BatchNorm"):
        propagate_placements(cg.gm, PassContext(2, 4))
    model.eval()
    cg = capture(model, batch, loss_fn)
    propagate_placements(cg.gm, PassContext(2, 4))


def test_unknown_op_on_sharded_input_names_op_node_and_shapes():
    class Sorts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cumsum(self.fc(x), dim=0)  # cumulative over the batch: no rule

    cg = capture(Sorts(), (torch.randn(6, 4), torch.randn(6, 4)), F.mse_loss)
    with pytest.raises(UnsupportedOpError) as e:
        propagate_placements(cg.gm, PassContext(2, 6))
    msg = str(e.value)
    assert "cumsum" in msg and "[6, 4]" in msg and "S(0)" in msg


def test_replicate_fallback_runs_unknown_ops_whole_and_warns_once(caplog):
    import logging

    from reference import eager_sgd

    class CumSum(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cumsum(self.fc(x), dim=0)

    torch.manual_seed(0)
    model = CumSum()
    batch = (torch.randn(6, 4), torch.randn(6, 4))
    cg = capture(model, batch, F.mse_loss)
    ctx = PassContext(2, 6, replicate_fallback=True)
    with caplog.at_level(logging.WARNING, logger="adaptdist.passes"):
        propagate_placements(cg.gm, ctx)
    warnings = [r for r in caplog.records if "replicate fallback" in r.getMessage()]
    assert len(warnings) == 1 and "cumsum" in warnings[0].getMessage()

    from adaptdist.lowering_options import LoweringOptions
    from passutil import lower_1d
    from adaptdist.runtime.simulate import simulate_ranks

    caplog.clear()
    cg = capture(model, batch, F.mse_loss)
    with caplog.at_level(logging.WARNING, logger="adaptdist.passes"):  # the pipeline propagates twice
        progs = lower_1d(cg, 2, state={f: dict(model.named_parameters())[f].detach() for f in cg.input_fqns},
                         options=LoweringOptions(replicate_fallback=True))
    assert len([r for r in caplog.records if "replicate fallback" in r.getMessage()]) == 1
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
    outs = simulate_ranks([p.module for p in progs.values()], ins)
    hist, _ = eager_sgd(model, [batch], F.mse_loss, 0.1, 1)
    for r in range(2):
        assert abs(float(outs[r][progs[r].loss_index]) - hist[0][0]) < 1e-5
        torch.testing.assert_close(outs[r][progs[r].output_roles.index("grad:fc.weight")], hist[0][1]["fc.weight"],
                                   atol=1e-5, rtol=1e-5)
