"""Pipeline lowering (issue 15, pp-core): stage programs run in one process (simulate_pipeline, GPipe order)
equal single-process eager: loss, every gradient and the SGD-updated parameters, to 1e-5."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model, lower, resolve_plan
from adaptdist.compiler.pipeline_lowering import PipelineOptions, pipeline_layers
from adaptdist.errors import PipelineError, UsageError
from adaptdist.lowering_options import LoweringOptions
from adaptdist.mesh import Mesh
from adaptdist.models import gpt
from adaptdist.plan import PipelineSpec, Plan, StageSpec
from adaptdist.runtime.simulate_pipeline import simulate_pipeline
from adaptdist.stage_program import PipelineRankProgram
from passutil import global_shard

LR = 0.1


def tiny_gpt(batch_size=4, seq_len=8, seed=0):
    torch.manual_seed(seed)
    cfg = gpt.GPTConfig(max_seq_len=seq_len, dim=16, num_layers=2, num_heads=2)
    return gpt.factory(batch_size, seq_len, cfg)


class DeepMLP(nn.Module):
    def __init__(self, widths=(12, 24, 20, 16, 5)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def deep_mlp(batch_size=8, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, 12, generator=g)
    y = torch.randint(0, 5, (batch_size,), generator=g)
    return DeepMLP(), (x, y), lambda out, t: F.cross_entropy(out, t)


def eager(model, batch, loss_fn):
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(*batch[:-1]), batch[-1])
    loss.backward()
    named = dict(ref.named_parameters())
    return loss.detach(), {f: p.grad for f, p in named.items()}, {f: (p - LR * p.grad).detach() for f, p in named.items()}


def check_against_eager(programs, batch, expected):
    loss, grads, params = expected
    sim = simulate_pipeline(programs, batch, lr=LR)
    assert torch.allclose(sim.loss, loss, rtol=1e-5, atol=1e-5), (sim.loss, loss)
    seen = set()
    for r, p in programs.items():
        st = p.stages[0]
        mesh = Mesh(tuple(st.submesh.items())) if st.submesh else None
        j = mesh.rank(tuple(st.coords[a] for a in mesh.names)) if mesh else 0
        order = [a for a in mesh.names if a != p.plan.batch_axis] if mesh else []
        for f, g in sim.grads[r].items():
            pls = p.state_placements.get(f)
            want = global_shard(grads[f], pls, mesh, j, order) if pls else grads[f]
            assert g.shape == want.shape, (r, f)
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=f"rank {r} grad {f}")
            want_p = global_shard(params[f], pls, mesh, j, order) if pls else params[f]
            torch.testing.assert_close(sim.params[r][f], want_p, rtol=1e-5, atol=1e-5, msg=f"rank {r} param {f}")
            seen.add(f)
    assert seen == set(grads), set(grads) - seen  # every gradient is somewhere
    return sim


CASES = [
    ("gpt", 2, 2, None), ("gpt", 2, 4, None), ("gpt", 4, 2, None), ("gpt", 4, 4, None),
    ("gpt", 2, 2, "pp=2,dp=2"), ("gpt", 2, 2, "pp=2,tp=2"),
    ("mlp", 2, 2, None), ("mlp", 4, 4, None), ("mlp", 2, 4, "pp=2,dp=2"),
]


@pytest.mark.parametrize("model,stages,microbatches,mesh", CASES)
def test_pipeline_equals_eager(model, stages, microbatches, mesh):
    m, batch, loss_fn = tiny_gpt(batch_size=8) if model == "gpt" else deep_mlp(batch_size=8)
    expected = eager(m, batch, loss_fn)
    world = stages * (2 if mesh else 1)
    plan = ManualPlan.parse("tp", gpt) if mesh and "tp=" in mesh else None
    progs = compile_model(m, batch, loss_fn, world, plan, mesh=mesh,
                          pipeline=PipelineOptions(stages=stages, microbatches=microbatches))
    assert sorted(progs) == list(range(world)) and all(isinstance(p, PipelineRankProgram) for p in progs.values())
    assert {p.stages[0].stage for p in progs.values()} == set(range(stages))
    sim = check_against_eager(progs, batch, expected)
    if model == "gpt":  # the tied embedding / head: held by the first and the last stage, identical after the step
        holders = [r for r, p in progs.items() if "tok_emb.weight" in p.state]
        first = {r for r, p in progs.items() if p.stages[0].is_first}
        last = {r for r, p in progs.items() if p.stages[0].is_last}
        assert first <= set(holders) and last <= set(holders)
        for r in holders:
            assert set(progs[r].grad_groups["tok_emb.weight"]) >= ({x for x in first | last
                                                                   if progs[x].stages[0].coords == progs[r].stages[0].coords})
            torch.testing.assert_close(sim.params[r]["tok_emb.weight"], sim.params[holders[0]]["tok_emb.weight"]) \
                if not progs[r].state_placements.get("tok_emb.weight") else None
    for p in progs.values():  # one activation and one gradient cross each cut of these models
        for st in p.stages:
            assert len(st.send_specs) == (0 if st.is_last else 1) and len(st.grad_in_specs) == len(st.send_specs)
            # the weight gradients are in backward_weight (zero-bubble's W), not in backward_input
            def mms(gm):
                return [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
            if mms(st.forward):
                assert mms(st.backward_weight)
            if st.is_first:  # nothing to send back: backward_input only hands its inputs on
                assert not [n for n in st.backward_input.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("mesh", [None, "pp=2,dp=2"])
def test_mse_against_one_hot_labels_lowers_without_gathering_the_batch(mesh):
    """``F.mse_loss(out, F.one_hot(y, C).float())`` (issue 14): one_hot checks its labels with all(y >= 0) and
    all(y < C) over the batch, all-reduced with min, which the pipeline computes in its prologue over every
    microbatch (as a cross-entropy's valid-token count); equal to eager."""
    m, batch, _ = deep_mlp(batch_size=8)

    def loss_fn(out, t):
        return F.mse_loss(out, F.one_hot(t, 5).float())

    expected = eager(m, batch, loss_fn)
    progs = compile_model(m, batch, loss_fn, 4 if mesh else 2, None, mesh=mesh,
                          pipeline=PipelineOptions(stages=2, microbatches=2))
    for p in progs.values():
        assert p.prologue is not None and set(p.prologue.reduce_ops) == {"min"}, p.prologue
    check_against_eager(progs, batch, expected)


def test_loss_is_the_global_sum_over_the_global_valid_token_count():
    """Two microbatches holding 11 and 101 valid tokens: the loss is the sum over all 112, not a mean of means."""
    m, (tokens, targets), loss_fn = tiny_gpt(batch_size=4, seq_len=64)
    targets = targets.clone()
    flat = targets.view(2, -1)  # microbatch 0 = rows 0-1, microbatch 1 = rows 2-3 (128 tokens each)
    flat[0, 11:] = -1
    flat[1, 101:] = -1
    batch = (tokens, targets)
    assert (targets[:2] != -1).sum() == 11 and (targets[2:] != -1).sum() == 101
    expected = eager(m, batch, loss_fn)
    progs = compile_model(m, batch, loss_fn, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    assert progs[0].prologue is not None and progs[0].prologue.reduce_ops == ("sum",)
    sim = check_against_eager(progs, batch, expected)
    with torch.no_grad():
        logits = m(tokens)
        mean_of_means = (loss_fn(logits[:2], targets[:2]) + loss_fn(logits[2:], targets[2:])) / 2
    assert abs(mean_of_means.item() - sim.loss.item()) > 1e-3  # the test can tell the two apart


def test_interleaved_stages_on_one_rank_group():
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    expected = eager(m, batch, loss_fn)
    progs = compile_model(m, batch, loss_fn, 2, None,
                          pipeline=PipelineOptions(stages=4, microbatches=2, schedule="interleaved-1f1b",
                                                   stages_per_rank=2))
    assert [[s.stage for s in p.stages] for p in progs.values()] == [[0, 2], [1, 3]]
    check_against_eager(progs, batch, expected)


@pytest.mark.parametrize("stages,microbatches,schedule,match", [
    (6, 2, "gpipe", r"6 stages needs at least 6 layers; the model has 5"),
    (2, 3, "gpipe", r"batch of 4 rows does not split into 1 replica\(s\) x 3 microbatches"),
    (2, 8, "gpipe", r"8 microbatches x 1 data-parallel replica\(s\) = 8 microbatches .* the batch has 4 rows"),
    (4, 2, "1f1b", r"2 microbatches < 4 stages"),
    (2, 2, "zigzag", r"unknown pipeline schedule 'zigzag'"),
])
def test_bad_pipelines_are_typed_errors_naming_the_numbers(stages, microbatches, schedule, match):
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(m, batch, loss_fn)
    with pytest.raises(PipelineError, match=match):
        resolve_plan(None, cg, stages, None, pipeline=PipelineOptions(stages, microbatches, schedule))


def _plan(cg, stages, mesh=None, microbatches=2):
    base = resolve_plan(None, cg, 2, None, pipeline=PipelineOptions(2, microbatches))
    return Plan(mesh=mesh or base.mesh, batch_axis=base.batch_axis, param_placements={},
                graph_fingerprint=base.graph_fingerprint, name="t",
                pipeline=PipelineSpec(tuple(stages), microbatches))


def test_stage_ranges_and_sub_meshes_are_checked_by_lower():
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(m, batch, loss_fn)
    layers = pipeline_layers(cg)
    assert layers == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f"]
    bad = _plan(cg, [StageSpec(("tok_emb", "pos_emb", "blocks.0")), StageSpec(("blocks.1", "lm_head"))])
    with pytest.raises(PipelineError, match=r"unknown layer\(s\) \['lm_head'\]; missing layer\(s\) \['ln_f'\]"):
        lower(cg, bad, LoweringOptions())
    skew = _plan(cg, [StageSpec(("tok_emb", "pos_emb", "blocks.0"), {"dp": 2}), StageSpec(("blocks.1", "ln_f"), {"tp": 2})],
                 mesh={"pp": 2, "dp": 2})
    with pytest.raises(PipelineError, match=r"stage 1 runs on sub-mesh \{'tp': 2\} but the plan's stage mesh is \{'dp': 2\}: stages on "
                       r"sub-meshes of different sizes may differ only in their data-parallel size"):
        lower(cg, skew, LoweringOptions())


def test_pipeline_programs_save_and_load(tmp_path):
    """The directory format: hash-checked sources and safetensors; the loaded programs compute the same step."""
    from adaptdist.program import check_artifacts
    from adaptdist.stage_program_io import is_pipeline_directory, load_pipeline_program, save_pipeline_programs

    m, batch, loss_fn = tiny_gpt(batch_size=4)
    progs = compile_model(m, batch, loss_fn, 4, None, mesh="pp=2,dp=2", pipeline=PipelineOptions(microbatches=2))
    d = save_pipeline_programs(progs, tmp_path / "programs")
    assert is_pipeline_directory(d) and check_artifacts(d, None)["kind"] == "pipeline"
    loaded = {r: load_pipeline_program(d, r, world_size=4) for r in progs}
    assert loaded[0].plan == progs[0].plan and loaded[3].grad_groups == progs[3].grad_groups
    assert loaded[1].stages[0].send_specs == progs[1].stages[0].send_specs
    a, b = simulate_pipeline(progs, batch, lr=LR), simulate_pipeline(loaded, batch, lr=LR)
    assert torch.equal(a.loss, b.loss)
    for r in progs:
        for f, g in a.grads[r].items():
            assert torch.equal(g, b.grads[r][f]), (r, f)
    (d / "rank2" / "program.py").write_text((d / "rank2" / "program.py").read_text() + "\n# edited\n")
    from adaptdist.errors import ProgramLoadError
    with pytest.raises(ProgramLoadError, match=r"rank2/program.py' does not match the sha256"):
        load_pipeline_program(d, 2)


def test_fsdp_inside_a_stage_is_refused_naming_the_parameters():
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(m, batch, loss_fn)
    plan = resolve_plan(ManualPlan.parse("fsdp"), cg, 4, "pp=2,dp=2", pipeline=PipelineOptions(microbatches=2))
    with pytest.raises(PipelineError, match=r"sharded over the batch axis .dp. inside a pipeline stage \(FSDP: blocks.0.attn.k.bias"):
        lower(cg, plan, LoweringOptions())


def test_pipeline_plan_json_round_trip_and_old_plans():
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(m, batch, loss_fn)
    plan = resolve_plan(None, cg, 4, "pp=2,dp=2", pipeline=PipelineOptions(microbatches=2, schedule="1f1b"))
    assert plan.mesh == {"pp": 2, "dp": 2} and plan.batch_axis == "dp" and plan.pipeline.schedule == "1f1b"
    assert [s.layers for s in plan.pipeline.stages] == [("tok_emb", "pos_emb", "blocks.0"), ("blocks.1", "ln_f")]
    again = Plan.from_json(plan.to_json(), "p.json")
    assert again == plan
    doc = json.loads(plan.to_json())
    doc["pipeline"]["microbatches"] = "two"
    with pytest.raises(UsageError, match=r"plan 'p.json': field 'pipeline'.*microbatches must be an integer"):
        Plan.from_json(json.dumps(doc), "p.json")
    doc = json.loads(plan.to_json())
    doc["schema_version"] = 2
    with pytest.raises(UsageError, match="schema_version 2 has no field 'pipeline'"):
        Plan.from_json(json.dumps(doc), "p.json")
    del doc["pipeline"]
    doc["mesh"] = [["dp", 2]]
    doc["param_placements"] = {}
    old = Plan.from_json(json.dumps(doc), "p.json")  # a version-2 plan still loads, without a pipeline
    assert old.pipeline is None


def test_stages_with_different_placements_on_one_sub_mesh_shape():
    """Stage 0 replicated, stage 1 Megatron-sharded over tp: each value crosses the cut in the placement the one
    lowering gave it, and the receiving stage's program reshards where its layers need another."""
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    expected = eager(m, batch, loss_fn)
    plan = ManualPlan("tp-late", ("tp",), None, (("blocks.1.fc.weight", ("S(0)",)), ("blocks.1.fc.bias", ("S(0)",)),
                                                 ("blocks.1.fc_out.weight", ("S(1)",))))
    progs = compile_model(m, batch, loss_fn, 4, plan, mesh="pp=2,tp=2", pipeline=PipelineOptions(microbatches=2))
    assert not progs[0].state_placements and progs[2].state_placements["blocks.1.fc.weight"] == ("S(0)",)
    assert progs[0].groups == {"adaptdist:tp": (0, 1)} and progs[3].groups == {"adaptdist:tp": (2, 3)}
    check_against_eager(progs, batch, expected)


def test_plan_pp_without_a_mesh_is_one_pipeline_over_every_rank():
    m, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(m, batch, loss_fn)
    plan = resolve_plan(None, cg, 4, None, pipeline=PipelineOptions())
    assert plan.mesh == {"pp": 4} and plan.pipeline.microbatches == 4 and plan.pipeline.schedule == "gpipe"
    assert [s.layers for s in plan.pipeline.stages] == [("tok_emb", "pos_emb"), ("blocks.0",), ("blocks.1",), ("ln_f",)]


class _SharedScale(nn.Module):
    """One nn.Parameter registered under two names (``scale`` and ``other.scale``), used before and after a cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.other = nn.Module()
        self.other.scale = self.scale

    def forward(self, x):
        h = torch.tanh(self.a(x)) * self.other.scale
        return self.c(torch.tanh(self.b(h)) * self.scale)


def test_a_parameter_of_the_model_itself_registered_twice_is_not_a_layer_and_pipelines_equal_eager():
    """Found by a new user: the tied target ``scale`` (the model's own tensor) was taken for a layer, so the
    planner's stages (which leave it out) failed the stage check."""
    torch.manual_seed(0)
    m = _SharedScale()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    cg = capture(copy.deepcopy(m), batch, F.mse_loss)
    assert pipeline_layers(cg) == ["a", "b", "c"]
    progs = compile_model(m, batch, F.mse_loss, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    check_against_eager(progs, batch, eager(m, batch, F.mse_loss))


class _PackedMaskAttention(nn.Module):
    """A mask built from positions as Hugging Face builds its packed-sequence masks (positions expanded over the
    batch, cumsum of the breaks, gathered with the batch's arange): a whole-batch constant each microbatch slices."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        b, s, _ = x.shape
        pos = torch.arange(s).expand(b, s)
        seq = (torch.cat([pos[:, :1] - 1, pos], 1).diff(dim=1) != 1).cumsum(1)
        rows = torch.arange(b)[:, None, None]
        same = seq[rows, torch.arange(s)[None, :, None]] == seq[rows, torch.arange(s)[None, None, :]]
        causal = torch.arange(s)[:, None] >= torch.arange(s)[None, :]
        scores = torch.where(same & causal, self.q(x) @ x.transpose(1, 2), torch.tensor(-1e4))
        return self.out(scores.softmax(-1) @ x).mean(1)


def test_a_constant_mask_over_the_whole_batch_is_one_slice_for_every_microbatch():
    """Found by a new user on HF Phi under --plan pp: the microbatches' programs differed by the rows they cut out
    of such a mask; its rows are equal (computed once at lowering), so every microbatch takes rows [0, n)."""
    torch.manual_seed(0)
    m = _PackedMaskAttention()
    batch = (torch.randn(8, 6, 8), torch.randn(8, 3))
    progs = compile_model(m, batch, F.mse_loss, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    check_against_eager(progs, batch, eager(m, batch, F.mse_loss))


class PooledMLP(DeepMLP):
    """DeepMLP with parameters the loss does not reach: a pooler read by the forward (its output dropped) and a
    head it never calls (BertModel's pooler under a token loss)."""

    def __init__(self):
        super().__init__()
        self.pooler = nn.Linear(16, 4)
        self.spare = nn.Linear(3, 3)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                pooled = self.pooler(x)
                del pooled
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


@pytest.mark.parametrize("mesh", [None, "pp=2,dp=2"])
def test_unused_parameters_are_held_by_a_stage_unchanged(mesh, tmp_path):
    """Parameters the loss does not reach (once a CaptureError; then dropped from every stage's state, so from
    checkpoints and model.safetensors): one stage holds each, no gradient, unchanged after the step; the used
    ones equal eager; they survive a save and load of the programs."""
    from adaptdist.stage_program_io import load_pipeline_program, save_pipeline_programs

    torch.manual_seed(0)
    m = PooledMLP()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g))
    loss_fn = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    ref = copy.deepcopy(m)
    loss = loss_fn(ref(batch[0]), batch[1])
    loss.backward()
    used = {f: p for f, p in ref.named_parameters() if p.grad is not None}
    unused = {f: p.detach() for f, p in ref.named_parameters() if p.grad is None}
    assert sorted(unused) == ["pooler.bias", "pooler.weight", "spare.bias", "spare.weight"]
    expected = (loss.detach(), {f: p.grad for f, p in used.items()}, {f: (p - LR * p.grad).detach() for f, p in used.items()})
    world = 4 if mesh else 2
    progs = compile_model(m, batch, loss_fn, world, None, mesh=mesh, pipeline=PipelineOptions(stages=2, microbatches=2))
    sim = check_against_eager(progs, batch, expected)
    for f, want in unused.items():
        holders = [r for r, p in progs.items() if f in p.state]
        assert holders and all(f not in progs[r].param_fqns for r in holders), (f, holders)
        for r in holders:
            # held as state, kept out of the optimizer (as eager's SGD skips a parameter whose .grad is None)
            assert torch.equal(progs[r].state[f], want) and f not in sim.grads[r] and f not in sim.params[r], (r, f)
    d = save_pipeline_programs(progs, tmp_path / "programs")
    loaded = {r: load_pipeline_program(d, r, world_size=world) for r in progs}
    assert all(set(loaded[r].state) == set(progs[r].state) for r in progs)
