"""Uneven batch splits that reach a non-leading dim or a merged dim (a seq-first model that transposes the batch
to dim 1 and back, a view [B, T, D] -> [B * T, D]) lower exactly: every rank simulated in one process equals
single-process eager (loss, gradients and the SGD-updated parameters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import compile_model
from adaptdist.placement import parse_placement
from adaptdist.runtime.simulate import simulate_ranks
from passutil import local_shard
from reference import eager_sgd

LR = 0.5


class SeqFirstLM(nn.Module):
    """``emb(idx).transpose(0, 1)`` ``[T, B, D]`` -> tanh(linear) (-> cumsum over T) -> transpose back -> output
    layer (tied to the embedding when ``tie``)."""

    def __init__(self, vocab=31, dim=10, tie=False, cumsum=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.out.weight = self.emb.weight
        self.cumsum = cumsum

    def forward(self, idx):
        h = torch.tanh(self.lin(self.emb(idx).transpose(0, 1)))
        if self.cumsum:
            h = torch.cumsum(h, dim=0)
        return self.out(h.transpose(0, 1))


def _lm_loss(out, t):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))


def check_programs_against_eager(model, batch, loss_fn, progs, world):
    """Run every rank of ``progs`` in one process; assert loss, every rank's gradient shard and its SGD-updated
    parameter shard (lr ``LR``) equal eager's."""
    outs = simulate_ranks([p.module for p in progs.values()],
                          [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()])
    history, final = eager_sgd(model, [batch], loss_fn, LR, 1)
    (loss, grads), = history
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, (r, float(outs[r][p.loss_index]), loss)
        placements = {f: v[0] for f, v in p.state_placements.items()}
        for f in p.param_fqns:
            pl = parse_placement(placements[f]) if f in placements else None
            grad = outs[r][p.output_roles.index(f"grad:{f}")]
            torch.testing.assert_close(grad, local_shard(grads[f], pl, world, r), atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f}")
            torch.testing.assert_close(p.state[f] - LR * grad, local_shard(final[f], pl, world, r), atol=1e-5,
                                       rtol=1e-5, msg=f"rank {r} SGD-updated {f}")


@pytest.mark.parametrize("tie,cumsum,batch_size,seq,world", [
    (False, False, 7, 5, 2), (True, True, 7, 5, 2), (False, False, 5, 3, 3), (True, True, 5, 2, 4)])
def test_fsdp_seq_first_model_with_uneven_batch_equals_eager(tie, cumsum, batch_size, seq, world):
    """FSDP, batch 7 on 2 ranks (4 + 3 rows; 20 + 15 rows of the merged [B * T] dim, where torch.chunk of 35
    would give 18 + 17): the S(1) -> S(0) all_to_all of the output layer's input gradient meets the rows of the
    viewed batch and must deliver exactly those rows (it is grouped by T), so the weight gradient's mm has
    matching shapes on every rank."""
    torch.manual_seed(0)
    model = SeqFirstLM(tie=tie, cumsum=cumsum)
    batch = (torch.randint(0, 31, (batch_size, seq)), torch.randint(0, 31, (batch_size, seq)))
    progs = compile_model(model, batch, _lm_loss, world, ManualPlan.parse("fsdp"))
    check_programs_against_eager(model, batch, _lm_loss, progs, world)
    kinds = {r.as_list()[-1] for r in progs[0].plan.lowered.redistributions["dp"]
             if r.as_list()[2].startswith("S") and r.as_list()[3].startswith("S")}
    assert kinds <= {"all_to_all_single"}, kinds  # no fallback to a gather: the rows are grouped chunk blocks


class SeqFirstNormLM(nn.Module):
    """A seq-first block with a LayerNorm (a multi-output op: its output is a ``getitem``) and a residual."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = nn.Embedding(31, 10), nn.LayerNorm(10)
        self.lin, self.out = nn.Linear(10, 10), nn.Linear(10, 31, bias=False)

    def forward(self, idx):
        h = self.ln(self.emb(idx).transpose(0, 1))
        h = torch.tanh(self.lin(h)) + h
        return self.out(h.transpose(0, 1))


@pytest.mark.parametrize("batch_size,seq,world", [(7, 5, 2), (5, 3, 3)])
def test_fsdp_seq_first_block_with_layer_norm_equals_eager(batch_size, seq, world, monkeypatch):
    """The rows an S(i) -> S(j) all_to_all must deliver are derived through a LayerNorm's getitem too (no
    fallback to a gather); loss, gradients and SGD-updated parameters equal eager. (The capture's reorder of
    ``lin``'s [T*B] rows, batch first, would leave no all_to_all here: it is off, the all_to_all is the point.)"""
    import adaptdist.compiler.capture as capture_mod

    monkeypatch.setattr(capture_mod, "reorder_batch_inner_merges", lambda gm: 0)
    torch.manual_seed(0)
    model = SeqFirstNormLM()
    batch = (torch.randint(0, 31, (batch_size, seq)), torch.randint(0, 31, (batch_size, seq)))
    progs = compile_model(model, batch, _lm_loss, world, ManualPlan.parse("fsdp"))
    check_programs_against_eager(model, batch, _lm_loss, progs, world)
    kinds = {r.as_list()[-1] for r in progs[0].plan.lowered.redistributions["dp"]
             if r.as_list()[2].startswith("S") and r.as_list()[3].startswith("S")}
    assert kinds == {"all_to_all_single"}, kinds


class BatchMixer(nn.Module):
    """An op over the batch dim (it mixes samples), then Linear -> ReLU -> Linear."""

    OPS = {
        "flip": lambda x: x + 0.5 * x.flip(0),
        "roll": lambda x: torch.roll(x, 1, dims=0),
        "normalize": lambda x: F.normalize(x, dim=0),
        "sort": lambda x: x.sort(0).values,
        "cumsum": lambda x: x - x.cumsum(0) / 3,
    }

    def __init__(self, op):
        super().__init__()
        self.op = self.OPS[op]
        self.l1 = nn.Linear(6, 9)
        self.l2 = nn.Linear(9, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(self.op(x))))


@pytest.mark.parametrize("op", sorted(BatchMixer.OPS))
def test_batch_dim_ops_under_dp_with_an_uneven_batch_equal_eager(op):
    """dp, batch 7 on 2 ranks: flip/roll/sort/cumsum over the batch run where DTensor's strategy moves the shard
    to the feature dim (S(0) -> S(1)); the following addmm then got a product partial over that dim and a whole
    bias, which had no rule (and --replicate-fallback did not help). The rule now reshards the activation back
    to its rows (S(1) -> S(0), an all_to_all), so the step lowers and equals eager."""
    torch.manual_seed(7)
    model = BatchMixer(op)
    batch = (torch.randn(7, 6), torch.randn(7, 3))
    progs = compile_model(model, batch, F.mse_loss, 2, ManualPlan.parse("dp"))
    check_programs_against_eager(model, batch, F.mse_loss, progs, 2)
    for r in progs[0].plan.lowered.redistributions["dp"]:
        if r.as_list()[0] == "addmm" and r.as_list()[2] != "R":
            assert r.as_list()[2:] == ["S(1)", "S(0)", "all_to_all_single"], r.as_list()


def test_replicate_fallback_runs_an_op_whose_rule_refuses_its_inputs(monkeypatch):
    """The advice of a rule's refusal (sharding_rules.unsupported) names --replicate-fallback: the flag must then
    run that op whole on every rank (it used to apply only to ops with no rule at all, so the advice did not
    help); the result equals eager."""
    from adaptdist.errors import UnsupportedOpError
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.passes import sharding_rules

    def refuses(node, pl):
        if any(not isinstance(pl(a), type(sharding_rules.R)) for _, a in sharding_rules.tensor_args(node)):
            raise sharding_rules.unsupported(node, pl, "refused for this test")
        return sharding_rules.RuleResult(sharding_rules.R)

    monkeypatch.setitem(sharding_rules.RULES, torch.ops.aten.addmm.default, refuses)
    torch.manual_seed(7)
    model = BatchMixer("roll")
    batch = (torch.randn(7, 6), torch.randn(7, 3))
    with pytest.raises(UnsupportedOpError, match="refused for this test.*--replicate-fallback"):
        compile_model(model, batch, F.mse_loss, 2, ManualPlan.parse("dp"))
    progs = compile_model(model, batch, F.mse_loss, 2, ManualPlan.parse("dp"), LoweringOptions(replicate_fallback=True))
    check_programs_against_eager(model, batch, F.mse_loss, progs, 2)
