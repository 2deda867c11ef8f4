"""Splitting a joint program into its forward and backward parts (adaptdist/compiler/partition.py)."""

import torch

from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture
from adaptdist.compiler.partition import split_forward_backward
from models import mlp, tiny_gpt


def _real_inputs(model, batch, captured):
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    return [named[f].detach() for f in captured.input_fqns] + list(batch)


def test_forward_then_backward_equal_the_joint_program():
    for model, batch, loss_fn in (mlp(7), tiny_gpt(3, 8)):
        captured = capture(model, batch, loss_fn)
        gm = captured.gm
        args = _real_inputs(model, batch, captured)
        joint = gm(*args)
        roles = gmeta.get_output_roles(gm.graph.output_node())
        sp = split_forward_backward(gm, ("loss",))
        assert sp.forward_roles == ["loss"] and sp.backward_roles == [r for r in roles if r != "loss"]
        fw = sp.forward(*[args[i] for i in sp.forward_inputs])
        outs, saved = fw[:1], fw[1:]
        assert len(saved) == sp.num_saved > 0
        bw = sp.backward(*saved, *[args[i] for i in sp.backward_inputs])
        by_role = dict(zip(sp.forward_roles + sp.backward_roles, list(outs) + list(bw)))
        for role, want in zip(roles, joint):
            torch.testing.assert_close(by_role[role], want, rtol=0, atol=0)


def test_nothing_the_forward_does_not_need_runs_in_it():
    model, batch, loss_fn = mlp(7)
    captured = capture(model, batch, loss_fn)
    sp = split_forward_backward(captured.gm, ("loss",))
    forward_ops = {str(n.target) for n in sp.forward.graph.nodes if n.op == "call_function"}
    # the gradients' matmuls and tanh's backward are backward work
    assert "aten.tanh_backward.default" not in forward_ops
    backward_ops = [str(n.target) for n in sp.backward.graph.nodes if n.op == "call_function"]
    assert "aten.tanh_backward.default" in backward_ops
    assert "aten.tanh.default" not in backward_ops  # saved by the forward, not recomputed


def test_backend_backward_drops_the_unread_loss_and_its_all_reduce():
    """The torch.compile backend's joint program returns the capture's scalar ``sum <out, tangent>``, never read:
    drop_backward_outputs removes it from the backward part, with its scalar all_reduce under dp (before: 2
    all_reduces in the backward, the loss's and the gradients' bucket; after: 1); ones_like(loss), the backward's
    seed, becomes a constant, so the loss is not computed at all. The other outputs are unchanged (run on 1 rank)."""
    import torch.nn as nn

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
    from adaptdist.compiler.lowering import lower, resolve_plan
    from adaptdist.compiler.partition import drop_backward_outputs
    from adaptdist.lowering_options import LoweringOptions

    seen = {}

    def capture_only(gm, example_inputs):
        seen["c"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), seen["world"])
        return gm.forward

    def backend_split(world):
        seen["world"] = world
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        torch.compile(model, backend=capture_only, dynamic=False)(torch.randn(4, 6))
        prog = lower(seen["c"], resolve_plan(ManualPlan.parse("dp"), seen["c"], world), LoweringOptions())[0]
        return prog, split_forward_backward(prog.graph_module, ("out:", "buffer:"))

    _, sp = backend_split(2)
    def reduces(gm):  # the all_reduces' shapes
        return [list(n.meta["val"].shape) for n in gm.graph.nodes if "all_reduce" in str(n.target)]

    assert reduces(sp.backward) == [[], [83]], reduces(sp.backward)
    dropped = drop_backward_outputs(sp, ("loss",))
    assert "loss" not in dropped.backward_roles and reduces(dropped.backward) == [[83]], reduces(dropped.backward)
    assert "ones_like" not in dropped.backward.code

    prog, sp = backend_split(1)
    args = [torch.randn(p.meta["val"].shape) for p in prog.graph_module.graph.find_nodes(op="placeholder")]
    fw = sp.forward(*[args[i] for i in sp.forward_inputs])
    saved = fw[len(sp.forward_roles):]
    want = dict(zip(sp.backward_roles, sp.backward(*saved, *[args[i] for i in sp.backward_inputs])))
    dropped = drop_backward_outputs(sp, ("loss",))
    got = dict(zip(dropped.backward_roles, dropped.backward(*saved, *[args[i] for i in dropped.backward_inputs])))
    assert set(got) == set(want) - {"loss"}
    for role, value in got.items():
        torch.testing.assert_close(value, want[role], rtol=0, atol=0, msg=role)
