"""The list-strategies pass: candidate strategies per node, from DTensor where torch has them."""

import pytest
import torch

from adaptdist import graph_meta as gmeta
from adaptdist.annotations import resolve_param_placements
from adaptdist.compiler.capture import capture
from adaptdist.errors import UnsupportedOpError
from adaptdist.models.gpt import TP_PLAN as GPT_TP
from adaptdist.models.llama import TP_PLAN as LLAMA_TP
from adaptdist.passes.context import PassContext
from adaptdist.passes.decompose_addmm import decompose_addmm
from adaptdist.passes.list_strategies import list_strategies
from adaptdist.passes.propagate_placements import propagate_placements
from adaptdist.passes.sharding_rules import tensor_args
from adaptdist.placement import Partial, Replicate, Shard
from models import mlp, tiny_gpt, tiny_llama

R, P = Replicate(), Partial()
# ops where we use a strategy torch's DTensor does not list: the vocabulary-parallel
# embedding's backward computes each rank's own rows, (grad R, indices R) -> S(0); the
# vocabulary-parallel cross entropy keeps log-softmax sharded over classes and picks targets
# per rank (Megatron's parallel cross entropy)
aten = torch.ops.aten
OURS_BEYOND_DTENSOR = {aten.embedding_dense_backward.default, aten._log_softmax.default,
                       aten._log_softmax_backward_data.default, aten.nll_loss_forward.default,
                       aten.nll_loss_backward.default}


def _listed(factory):
    model, batch, loss_fn = factory()
    cg = capture(model, batch, loss_fn)
    list_strategies(cg.gm, PassContext(2, cg.batch_size))
    return model, cg


def test_matmul_strategies_are_dtensors():
    _, cg = _listed(lambda: mlp(4))
    mm = next(n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    got = {(s.inputs, s.outputs) for s in gmeta.get_strategies(mm)}
    assert {s.source for s in gmeta.get_strategies(mm)} == {"dtensor"}
    # row/column parallel, contraction into a partial sum, replicated
    assert ((Shard(0), R), (Shard(0),)) in got and ((R, Shard(1)), (Shard(1),)) in got
    assert ((Shard(1), Shard(0)), (P,)) in got and ((R, R), (R,)) in got


def test_cpu_flash_attention_strategies_are_ours():
    """DTensor has no strategy for CPU flash attention; ours shards batch or heads."""
    _, cg = _listed(lambda: tiny_gpt(4, 8))
    attn = next(n for n in cg.gm.graph.nodes
                if n.target == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    sts = gmeta.get_strategies(attn)
    assert {s.source for s in sts} == {"adaptdist"}
    assert any(s.inputs == (Shard(0),) * 3 and s.outputs[0] == Shard(0) for s in sts)  # batch
    assert any(s.inputs == (Shard(1),) * 3 and s.outputs[0] == Shard(1) for s in sts)  # heads


def test_placeholders_may_be_replicated_or_sharded_on_any_dim():
    _, cg = _listed(lambda: mlp(4))
    w = next(n for n in cg.gm.graph.nodes if gmeta.get_fqn(n) == "fc1.weight")
    assert [s.outputs for s in gmeta.get_strategies(w)] == [(R,), (Shard(0),), (Shard(1),)]


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("plan", ["dp", "tp", "fsdp"])
def test_what_propagation_chooses_is_a_listed_strategy(model, plan):
    """Our rules agree with DTensor's strategies on every node of the joint graph (and with our own
    listing where DTensor has none): each node's input placements (after redistribution) and output
    placement form one of its candidates."""
    factory, tp = {"gpt": (lambda: tiny_gpt(4, 8, num_heads=4), GPT_TP), "llama": (lambda: tiny_llama(4, 8), LLAMA_TP)}[model]
    m, batch, loss_fn = factory()
    cg = capture(m, batch, loss_fn)
    shapes = {n: tuple(t.shape) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    pp = {"dp": {}, "tp": resolve_param_placements(shapes, tp), "fsdp": {f: Shard(0) for f in shapes}}[plan]
    ctx = PassContext(2, cg.batch_size, shard_batch=plan != "tp", param_placements=pp)
    gm, _ = decompose_addmm(cg.gm, ctx)
    propagate_placements(gm, ctx)
    list_strategies(gm, ctx)
    checked = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        needs = gmeta.get_redistribute(n)
        ins = tuple(needs.get(path, gmeta.get_placements(a))[0] for path, a in tensor_args(n))
        out = gmeta.get_placements(n)[0]
        outs = out if isinstance(out, tuple) else (out,)
        sts = gmeta.get_strategies(n)
        if any(s.source == "dtensor" for s in sts) and n.target not in OURS_BEYOND_DTENSOR:
            sts = [s for s in sts if s.source == "dtensor"]  # where torch has strategies, ours must be one
        assert any(s.inputs == ins and s.outputs == outs for s in sts), (
            f"{n.name} ({n.target}): chose {ins} -> {outs}, not among {sts}")
        checked += 1
    assert checked > 200


def test_an_op_without_any_strategy_is_refused_by_name():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            y = x @ self.w
            return y * torch.nn.functional.pdist(y).sum()  # (linalg.matrix_exp has a rule now: batched_core; trace too)

    cg = capture(Odd(), (torch.randn(4, 4), torch.randn(4, 4)), torch.nn.functional.mse_loss)
    with pytest.raises(UnsupportedOpError, match="_pdist_forward.*no sharding strategy in DTensor"):
        list_strategies(cg.gm, PassContext(2, 4))
    list_strategies(cg.gm, PassContext(2, 4, replicate_fallback=True))  # opted in: replicated
