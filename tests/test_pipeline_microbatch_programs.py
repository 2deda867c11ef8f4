"""Pipeline microbatches run one program (pp-fix): models whose SPMD lowering used to bake a microbatch's row
offset into a constant (HF GPT-2's DynamicCache cat with an empty tensor, the backward of a masked mean, a
zero-filled expert buffer) train under pp equal to eager, in one process (simulate_pipeline)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions, _program_difference
from test_pipeline_lowering import LR, check_against_eager, eager

V = 50


def _batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y[0, :] = -100
    y[1:B // 2, 2:] = -100
    return x, y


class HFGPT2(nn.Module):
    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0,
                                      embd_pdrop=0, attn_pdrop=0, tie_word_embeddings=True)
        self.m = transformers.GPT2LMHeadModel(cfg)

    def forward(self, x):
        return self.m(input_ids=x).logits


class Experts(nn.Module):
    """A stacked-expert layer that fills a zero buffer (new_zeros) per token."""
    def __init__(self, d=8, e=2):
        super().__init__()
        self.gate = nn.Linear(d, e)
        self.w = nn.Parameter(torch.randn(e, d, d) * 0.3)

    def forward(self, x):
        out = x.new_zeros(x.shape)
        p = self.gate(x).softmax(-1)
        for k in range(self.w.shape[0]):
            out = out + p[..., k:k + 1] * (x @ self.w[k])
        return out


class Tokens(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList([Experts(d), Experts(d)])
        self.head = nn.Linear(d, V)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def ce(lg, y):
    return F.cross_entropy(lg.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def masked_mean(lg, y):
    m = y != -100
    lo = F.cross_entropy(lg.reshape(-1, V), y.clamp(min=0).reshape(-1), reduction="none").reshape(y.shape)
    return (lo * m).sum() / m.sum()


def smooth(lg, y):
    return F.cross_entropy(lg.reshape(-1, V), y.reshape(-1), ignore_index=-100, label_smoothing=0.1)


@pytest.mark.parametrize("name", ["hf_gpt2", "moe_masked_mean", "moe_smooth"])
def test_microbatches_share_one_program(name):
    torch.manual_seed(1234)
    model, loss_fn = (HFGPT2(), ce) if name == "hf_gpt2" else (Tokens(), masked_mean if "masked" in name else smooth)
    batch = _batch(6, 8)
    expected = eager(model, batch, loss_fn)
    progs = compile_model(model, batch, loss_fn, 2, None, pipeline=PipelineOptions(stages=2, microbatches=3))
    check_against_eager(progs, batch, expected)


def test_difference_message_names_the_node():
    def f(x):
        return x[0:2] + 1

    def g(x):
        return x[2:4] + 1
    msg = _program_difference(torch.fx.symbolic_trace(f), torch.fx.symbolic_trace(g))
    assert "getitem" in msg and "microbatch 0 runs" in msg and "--rng local" not in msg and "--plan dp" in msg


class MLP(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.head = nn.Linear(d, V)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


CW = torch.linspace(0.2, 3.0, V)


def weighted(lg, y):
    return F.cross_entropy(lg.reshape(-1, V), y.reshape(-1), weight=CW, ignore_index=-100)


def test_weighted_cross_entropy_normalizer_in_prologue():
    """F.cross_entropy(weight=...)'s normalizer (the valid targets' class weights summed) comes from the batch
    alone: the prologue computes it, and the pipeline equals eager."""
    torch.manual_seed(1234)
    model, batch = MLP(), _batch(6, 8)
    expected = eager(model, batch, weighted)
    progs = compile_model(model, batch, weighted, 2, None, pipeline=PipelineOptions(stages=2, microbatches=3))
    assert all(p.prologue is not None for p in progs.values())
    check_against_eager(progs, batch, expected)


def test_square_of_mean_refused_naming_the_value():
    from adaptdist.errors import PipelineError
    torch.manual_seed(1234)
    with pytest.raises(PipelineError) as e:
        compile_model(MLP(), _batch(6, 8), lambda lg, y: ce(lg, y) ** 2, 2, None,
                      pipeline=PipelineOptions(stages=2, microbatches=3))
    msg = str(e.value)
    assert "BatchNorm statistics)" not in msg and "aten.div.Tensor" in msg and "pow" in msg and "sum" in msg
    # where in the loss the batch mean is taken: ce's line (the capture's record of the mean's division)
    import inspect
    line = inspect.getsourcelines(ce)[1] + 1
    assert f"in the loss function (test_pipeline_microbatch_programs.py:{line}: `return F.cross_entropy(" in msg, msg


def test_mesh_preset_takes_the_model_files_tp_plan():
    """--plan pp / --mesh pp=2,tp=2: the tp axis uses the model file's TP_PLAN (it was parsed without the file)."""
    from types import SimpleNamespace

    from adaptdist.compiler.pipeline_lowering import mesh_preset
    from adaptdist.errors import UsageError
    module = SimpleNamespace(TP_PLAN={"layers.*.weight": "S(0)"})
    p = mesh_preset("pp=2,tp=2", module)
    assert p.mesh_axes == ("tp",) and dict(p.params) == {"layers.*.weight": ("S(0)",)}
    assert mesh_preset("pp=2,tp=2,dp=2", module).mesh_axes == ("dp", "tp")
    assert mesh_preset("pp=2,dp=2", None) is None and mesh_preset(None, None) is None
    # no TP_PLAN: no preset; the planner places the parameters as the stage ILP chose (test_pipeline_submesh.py)
    assert mesh_preset("pp=2,tp=2", SimpleNamespace()) is None
    with pytest.raises(UsageError, match="TP_PLAN"):
        mesh_preset("pp=2,tp=2", SimpleNamespace(TP_PLAN=["not a dict"]))


def test_estimate_refuses_pipeline_plans_plainly(capsys):
    from adaptdist.cli.main import main
    from test_pipeline_cli import COMMON, MODEL
    assert main(["estimate", MODEL, *COMMON, "--nproc", "2", "--plan", "pp"]) == 2
    err = capsys.readouterr().err
    assert "does not support pipeline plans" in err and "neither auto" not in err


def test_resume_names_the_default_schedule(tmp_path):
    import json
    from types import SimpleNamespace

    from adaptdist.cli.train import _restored_args
    from adaptdist.errors import UsageError
    (tmp_path / "run.json").write_text(json.dumps({"settings": {"schedule": None, "microbatches": 3}}))
    args = SimpleNamespace(resume=str(tmp_path), schedule="gpipe", microbatches=None, steps=5)
    with pytest.raises(UsageError, match=r"--schedule was not set \(the default, 1f1b\) there, not 'gpipe'"):
        _restored_args(args, {"schedule": None, "microbatches": None, "steps": 10}, keys=("microbatches", "schedule"))


def test_schedule_advice_splits_the_batch():
    from adaptdist.compiler.pipeline_lowering import check_schedule
    from adaptdist.errors import PipelineError
    with pytest.raises(PipelineError, match="use --microbatches 2$"):
        check_schedule("interleaved-1f1b", 4, 3, 2, rows=6)  # 4 (the next multiple of 2) does not split 6 rows
    with pytest.raises(PipelineError, match="use --microbatches 6, or --schedule gpipe"):
        check_schedule("1f1b", 4, 3, 1, rows=6)
    with pytest.raises(PipelineError, match="no such count splits the 3 batch rows"):
        check_schedule("1f1b", 4, 3, 1, rows=3)


def test_resumed_pipeline_mesh_resizes_dp():
    from adaptdist.cli.train import _pipeline_mesh_for
    assert _pipeline_mesh_for("pp=2,dp=2", 2) == "pp=2,dp=1"
    assert _pipeline_mesh_for("pp=2,dp=2", 6) == "pp=2,dp=3"
    assert _pipeline_mesh_for("pp=2,tp=2", 8) == "pp=2,tp=2,dp=2"
    assert _pipeline_mesh_for("pp=2,dp=2", 3) == "pp=2,dp=2"  # no fit: the lowering names the numbers
    assert _pipeline_mesh_for("dp=2,tp=2", 2) == "dp=2,tp=2"  # not a pipeline: unchanged


def test_saved_pipeline_plan_refuses_other_microbatches(tmp_path):
    import json
    from types import SimpleNamespace

    from adaptdist.cli.pipeline_flags import wants_pipeline
    from adaptdist.errors import UsageError
    f = tmp_path / "pp_plan.json"
    f.write_text(json.dumps({"pipeline": {"microbatches": 3, "schedule": "1f1b", "stages": []}}))
    assert not wants_pipeline(SimpleNamespace(plan=str(f), mesh=None, microbatches=3, schedule="1f1b"))
    with pytest.raises(UsageError, match=r"--schedule gpipe differs from the saved pipeline plan .*'1f1b'"):
        wants_pipeline(SimpleNamespace(plan=str(f), mesh=None, microbatches=None, schedule="gpipe"))


def _rows(B=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 16, generator=g), torch.randint(0, 4, (B,), generator=g)


def _sequential_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("loss_fn", [
    lambda o, t: ((o[:, 0] - t.float()) ** 2).mean(),
    lambda o, t: -o.log_softmax(-1).gather(1, t[:, None]).mean(),
], ids=["mean-of-squares", "gather-mean"])
def test_a_hand_written_mean_loss_runs_one_microbatch_program(loss_fn):
    """A hand-written nn.Sequential MLP with a loss written as ``(...).mean()``: the mean's backward (an expand
    divided by the row count) has alike rows, so each microbatch takes rows [0, n) of it and the pipeline equals
    eager (it was refused: "the step's program differs between microbatches")."""
    model, batch = _sequential_mlp(), _rows()
    expected = eager(model, batch, loss_fn)
    progs = compile_model(model, batch, loss_fn, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    check_against_eager(progs, batch, expected)


def test_rows_cut_from_a_whole_batch_value_are_named_with_the_fix():
    """Indexing rows with torch.arange(batch) builds its backward over the whole batch (an index_put), which each
    microbatch would cut at its own offset: refused, naming that value and what to write instead."""
    from adaptdist.errors import PipelineError

    with pytest.raises(PipelineError) as e:
        compile_model(_sequential_mlp(), _rows(), lambda o, t: -o.log_softmax(-1)[torch.arange(o.shape[0]), t].mean(),
                      2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    msg = str(e.value)
    for part in ("differs between microbatches 0 and 1", "in the loss function", "(index_put)", "over the whole batch",
                 "torch.arange(batch)", "F.cross_entropy", "--plan dp"):
        assert part in msg, (part, msg)


class RepeatedPositions(nn.Module):
    """HF Whisper's decoder positions: ``arange(T).unsqueeze(0).repeat(B, 1)`` indexing a learned table
    (``weight[position_ids]``, aten.index), whose backward is an accumulating index_put into zeros."""
    def __init__(self, d=8, t_max=16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.pos = nn.Parameter(torch.randn(t_max, d) * 0.3)
        self.layers = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.head = nn.Linear(d, V)

    def forward(self, x):
        position_ids = torch.arange(x.shape[1]).unsqueeze(0).repeat(x.shape[0], 1)
        h = self.emb(x) + self.pos[position_ids]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_positions_repeated_over_the_batch_run_one_microbatch_program():
    torch.manual_seed(1234)
    model = RepeatedPositions()
    batch = _batch(6, 8)
    expected = eager(model, batch, ce)
    progs = compile_model(model, batch, ce, 2, None, pipeline=PipelineOptions(stages=2, microbatches=3))
    check_against_eager(progs, batch, expected)


class HFWhisper(nn.Module):
    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.WhisperConfig(
            vocab_size=V, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
            max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
            decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)
        cfg._attn_implementation = "eager"
        self.m = transformers.WhisperForConditionalGeneration(cfg)

    def forward(self, feats, ids):
        return self.m(input_features=feats, decoder_input_ids=ids).logits


def test_hf_whisper_trains_under_pp_equal_to_eager():
    torch.manual_seed(0)
    model = HFWhisper()
    g = torch.Generator().manual_seed(3)
    x, y = _batch(4, 8)
    batch = (torch.randn(4, 8, 16, generator=g), x, y.clamp(min=0))
    ref = copy.deepcopy(model)
    loss = ce(ref(*batch[:-1]), batch[-1])
    loss.backward()
    named = {f: p for f, p in ref.named_parameters() if p.requires_grad}  # the encoder's positions are frozen
    expected = (loss.detach(), {f: p.grad for f, p in named.items()},
                {f: (p - LR * p.grad).detach() for f, p in named.items()})
    progs = compile_model(model, batch, ce, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    check_against_eager(progs, batch, expected)


class ReversedRows(nn.Module):
    """Reads its rows in reverse batch order (a gather along the batch dim with an index built from
    torch.arange(batch)): each microbatch's program shifts that index by its own row offset."""
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        idx = torch.arange(x.shape[0]).flip(0)[:, None].expand(x.shape)
        return torch.tanh(self.lin(x).gather(0, idx))


class RowsModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d), ReversedRows(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_microbatch_difference_names_the_module_and_source_line():
    """The generic refusal (not a cut of a whole-batch value) names the user's module path and file:line, found
    through the capture's record of each node's source (the node that differs is the lowering's shifted index,
    which has none: its nearest neighbour's)."""
    import inspect

    from adaptdist.errors import PipelineError

    torch.manual_seed(0)
    with pytest.raises(PipelineError) as e:
        compile_model(RowsModel(), _rows(), F.cross_entropy, 2, None,
                      pipeline=PipelineOptions(stages=2, microbatches=2))
    msg = str(e.value)
    lines, first = inspect.getsourcelines(ReversedRows.forward)
    line = first + next(i for i, t in enumerate(lines) if "idx = torch.arange" in t)
    for part in ("differs between microbatches 0 and 1", "in module `layers.1` (ReversedRows)",
                 f"(test_pipeline_microbatch_programs.py:{line}: `idx = torch.arange(x.shape[0]).flip(0)",
                 "(a value that depends on the microbatch's rows"):
        assert part in msg, (part, msg)


def reversed_rows(h):
    return h.gather(0, torch.arange(h.shape[0]).flip(0)[:, None].expand(h.shape))  # rows reversed (helper)


class RowsInAHelper(nn.Module):
    """ReversedRows's op written in a free function or a method its forward calls."""
    def __init__(self, d=16, method=False):
        super().__init__()
        self.lin, self.method = nn.Linear(d, d), method

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(self.reverse(h) if self.method else reversed_rows(h))

    def reverse(self, h):
        idx = torch.arange(h.shape[0]).flip(0)[:, None].expand(h.shape)  # rows reversed (method)
        return h.gather(0, idx)


def reversed_rows_loss(out, target):
    return F.cross_entropy(reversed_rows(out), target.flip(0))


@pytest.mark.parametrize("where", ["helper", "method", "loss"])
def test_microbatch_difference_names_the_line_in_a_helper_method_or_loss(where):
    """The differing op written in a free function or a method the forward calls, or in the loss function: the
    message names that line, the innermost of the user's code (before: the forward's line that called it, or, for
    the loss, no line: torch's stack traces keep only frames named forward)."""
    import inspect

    from adaptdist.errors import PipelineError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), RowsInAHelper(method=where == "method"), nn.Linear(16, 4))
    loss = F.cross_entropy
    if where == "loss":
        model, loss = _sequential_mlp(), reversed_rows_loss
    fn = RowsInAHelper.reverse if where == "method" else reversed_rows
    marker = "# rows reversed (method)" if where == "method" else "# rows reversed (helper)"
    lines, first = inspect.getsourcelines(fn)
    line = first + next(i for i, t in enumerate(lines) if marker in t)
    with pytest.raises(PipelineError) as e:
        compile_model(model, _rows(), loss, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    msg = str(e.value)
    where_part = "in the loss function" if where == "loss" else "in module `1` (RowsInAHelper)"
    for part in ("differs between microbatches 0 and 1", f"{where_part} (test_pipeline_microbatch_programs.py:{line}: "):
        assert part in msg, (part, msg)
