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
