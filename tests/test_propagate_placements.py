import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture
from adaptdist.errors import UnsupportedOpError
from adaptdist.passes.context import PassContext
from adaptdist.passes.propagate_placements import placement_of, propagate_placements
from models import pairwise_distances
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


def test_training_batch_norm_keeps_the_batch_split_and_eval_is_fine():
    # DDP's per-rank statistics by default (tests/test_batch_norm.py checks the numbers, and --batch-norm sync)
    model, batch, loss_fn = convnet(4, batch_norm=True)
    cg = capture(model, batch, loss_fn)
    propagate_placements(cg.gm, PassContext(2, 4))
    bn = next(n for n in cg.gm.graph.nodes if n.target == torch.ops.aten._native_batch_norm_legit_functional.default)
    assert placement_of(bn)[0] == Shard(0)
    model.eval()
    cg = capture(model, batch, loss_fn)
    propagate_placements(cg.gm, PassContext(2, 4))


def test_unknown_op_on_sharded_input_names_op_node_and_shapes():
    cg = capture(*pairwise_distances())
    with pytest.raises(UnsupportedOpError) as e:
        propagate_placements(cg.gm, PassContext(2, 6))
    msg = str(e.value)
    assert "cdist" in msg and "[6, 4]" in msg and "S(0)" in msg


def test_replicate_fallback_runs_unknown_ops_whole_and_warns_once(caplog):
    import logging

    from reference import eager_sgd

    model, batch, _ = pairwise_distances()
    cg = capture(model, batch, F.mse_loss)
    ctx = PassContext(2, 6, replicate_fallback=True)
    with caplog.at_level(logging.WARNING, logger="adaptdist.passes"):
        propagate_placements(cg.gm, ctx)
    warnings = [r for r in caplog.records if "replicate fallback" in r.getMessage()]
    assert len(warnings) == 1 and "cdist" in warnings[0].getMessage()

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


# ---------------------------------------------------------------- ops DDP trains, under every plan
#
# Propagation draws on the sources the planner chooses from (our rule, then DTensor's strategies), so
# an op the automatic plan lowers is lowered by dp and fsdp too. Each model below once failed under
# dp with "no sharding rule"; on 2 gloo ranks, 3 SGD steps equal eager (loss, gradients, parameters).

class _TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.topk(self.fc(x), 3, dim=-1).values.sum(-1)


class _PaddingMask(nn.Module):
    """The padding-mask lookup of Hugging Face's masking_utils: ``mask[batch_idx, kv_idx]`` (aten.index)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, ids, mask):
        b, t = ids.shape
        keep = mask.bool()[torch.arange(b)[:, None, None], torch.arange(t)[None, None, :]]  # [B, 1, T]
        h = self.fc(self.emb(ids))
        return (h * keep.transpose(1, 2).to(h.dtype)).mean((1, 2))


class _BatchNormNoStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6, track_running_stats=False)  # _native_batch_norm_legit.no_stats

    def forward(self, x):
        return self.bn(self.fc(x)).pow(2).sum(-1)


class _ShiftRight(nn.Module):
    """``shifted[..., 1:] = ids[..., :-1]`` (aten.copy into a slice), as decoder inputs are made."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1]
        return self.emb(shifted).mean((1, 2))


def _per_sample(model_cls, make_inputs):
    def factory(seed=0):
        torch.manual_seed(0)
        model = model_cls()
        g = torch.Generator().manual_seed(seed)
        return model, make_inputs(g) + (torch.randn(5, generator=g),), F.mse_loss
    return factory


def _ids(g):
    return (torch.randint(0, 11, (5, 7), generator=g),)


def _ids_and_mask(g):
    ids = _ids(g)[0]
    lengths = torch.randint(2, 8, (5,), generator=g)
    return ids, (torch.arange(7)[None, :] < lengths[:, None]).long()


def _hf_llama(seed=0):
    """A Hugging Face LLaMA from a config (GQA, eager attention, a padding mask): its mask path indexes."""
    transformers = pytest.importorskip("transformers")

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                           use_cache=False, attn_implementation="eager")
            self.model = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).logits

    torch.manual_seed(0)
    model = CausalLM()
    g = torch.Generator().manual_seed(seed)
    ids, mask = _ids_and_mask(g)
    ids = ids % 16
    return model, (ids, mask, torch.randint(0, 16, (5, 7), generator=g)), \
        lambda logits, y: F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))


SAMPLE_INDEPENDENT = {
    "topk": _per_sample(_TopK, lambda g: (torch.randn(5, 8, generator=g),)),
    "padding_mask_index": _per_sample(_PaddingMask, _ids_and_mask),
    "batch_norm_no_stats": _per_sample(_BatchNormNoStats, lambda g: (torch.randn(5, 8, generator=g),)),
    "copy_into_slice": _per_sample(_ShiftRight, _ids),
    "hf_llama_padding_mask": _hf_llama,
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ops_ddp_trains_lower_under_dp_and_fsdp_and_equal_eager(tmp_path):
    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.mesh import Mesh
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local
    from dist_workers import multi_case_sgd_worker
    from passutil import global_shard
    from reference import eager_sgd

    steps, lr, tol = 3, 0.02, 1e-5
    prepared, launch_cases = [], []
    for name, factory in SAMPLE_INDEPENDENT.items():
        for plan in ("dp", "fsdp"):
            model, example, loss_fn = factory()
            batches = [factory(seed=10 + s)[1] for s in range(steps)]
            programs = compile_model(model, example, loss_fn, 2, ManualPlan.parse(plan))
            save_programs(programs, tmp_path / f"{name}-{plan}")
            launch_cases.append((str(tmp_path / f"{name}-{plan}"), batches, None))
            prepared.append((f"{name} {plan}", model, loss_fn, batches, programs))
    results = launch_local(multi_case_sgd_worker, (launch_cases, lr, steps), 2)
    for i, (label, model, loss_fn, batches, programs) in enumerate(prepared):
        history, final = eager_sgd(model, batches, loss_fn, lr, steps)
        mesh = Mesh(tuple(programs[0].mesh.items()))
        for r in range(2):
            res, pls = results[r][i], programs[r].state_placements
            assert programs[r].batch_slice[1] in (2, 3), label  # the batch is split: the op kept samples apart
            for s, (loss, grads) in enumerate(history):
                assert res["losses"][s] == pytest.approx(loss, rel=tol, abs=tol), (label, r, s)
                assert set(res["grads"][s]) == set(grads), label
                for f, g in res["grads"][s].items():
                    torch.testing.assert_close(g, global_shard(grads[f], pls.get(f), mesh, r, ["dp"]), atol=tol,
                                               rtol=tol, msg=f"{label}: rank {r} step {s} grad {f}")
            for f, p in res["params"].items():
                torch.testing.assert_close(p, global_shard(final[f], pls.get(f), mesh, r, ["dp"]), atol=tol,
                                           rtol=tol, msg=f"{label}: rank {r} param {f}")
