"""adaptdist/hf_tp_plan.py: a Hugging Face model's own tensor-parallel plan read for ``--plan tp`` where the model
file defines no TP_PLAN; trained through it, the model computes as eager (loss, gradient shards, SGD-updated
parameters)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

from adaptdist.annotations import ManualPlan  # noqa: E402
from adaptdist.errors import UsageError  # noqa: E402
from adaptdist.hf_tp_plan import hf_tp_plan  # noqa: E402

from models import hf_llama  # noqa: E402


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def test_llama_plan_column_then_row_parallel_under_a_wrapper():
    """Wrapped (tests/models.py's _HFLlama holds the LlamaForCausalLM as ``model``): q/k/v and the MLP's gate/up
    column-parallel, o and down row-parallel, the embedding and the untied head by vocabulary; norms whole."""
    model = hf_llama()[0]
    plan = hf_tp_plan(model)
    layer = "model.model.layers.1."
    assert {k: plan[layer + k] for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
                                         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")} == {
        "self_attn.q_proj.weight": "S(0)", "self_attn.k_proj.weight": "S(0)", "self_attn.o_proj.weight": "S(1)",
        "mlp.gate_proj.weight": "S(0)", "mlp.up_proj.weight": "S(0)", "mlp.down_proj.weight": "S(1)"}
    assert plan["model.model.embed_tokens.weight"] == "S(0)" and plan["model.lm_head.weight"] == "S(0)"
    assert not any("norm" in k for k in plan)
    assert set(plan) <= {n for n, _ in model.named_parameters()}


def test_qwen2_biases_follow_their_column_parallel_weights():
    plan = hf_tp_plan(_qwen2())
    assert plan["model.layers.0.self_attn.q_proj.bias"] == "S(0)"
    assert "model.layers.0.self_attn.o_proj.bias" not in plan  # o_proj has no bias; row-parallel biases stay whole


def test_a_model_without_a_plan_gives_none_and_parse_says_what_to_write():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0))
    assert hf_tp_plan(gpt2) == {}
    with pytest.raises(UsageError, match="GPT2LMHeadModel carries none.*add one"):
        ManualPlan.parse("tp", types.SimpleNamespace(), gpt2)
    with pytest.raises(UsageError, match="defines none"):
        ManualPlan.parse("tp", types.SimpleNamespace())


def test_a_model_file_tp_plan_wins_over_the_models_own():
    model = hf_llama()[0]
    own = {"model.model.layers.*.mlp.up_proj.weight": "S(0)"}
    plan = ManualPlan.parse("tp", types.SimpleNamespace(TP_PLAN=own), model)
    assert [g for g, _ in plan.params] == list(own)


@pytest.mark.parametrize("key", ["tp", "dp,tp"])
def test_llama_trained_with_its_own_plan_computes_as_eager(key):
    """The programs of the Llama's own plan, all ranks run in one process for 2 SGD steps: every loss, each rank's
    gradient shard and parameter shard equal eager's (test_capture_edge_cases.train_simulated); the weights are
    really sharded."""
    from test_capture_edge_cases import train_simulated

    model, batch, loss_fn = hf_llama()
    plan = ManualPlan.parse(key, types.SimpleNamespace(), model)
    progs = train_simulated(model, batch, loss_fn, 2 if key == "tp" else 4, plan, steps=2)
    placements = progs[0].state_placements
    assert repr(placements["model.model.layers.0.mlp.down_proj.weight"]).count("S(1)") == 1, placements


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_plan_tp_on_a_hugging_face_model_file_without_tp_plan(tmp_path):
    """``adaptdist train tests/models.py:hf_llama --plan tp`` (that file defines no TP_PLAN) on 2 gloo ranks: the
    model's own plan, printed as the plan's name; 3 SGD steps give eager's losses and parameters."""
    from pathlib import Path

    from adaptdist.cli import main
    from test_capture_edge_cases import assert_train_equals_eager_sgd

    out = tmp_path / "run"
    file = Path(__file__).with_name("models.py")
    rc = main(["train", f"{file}:hf_llama", "--nproc", "2", "--plan", "tp", "--batch-size", "4", "--seq-len", "8",
               "--steps", "3", "--lr", "0.1", "--optimizer", "sgd", "--sample-bytes", "0", "--out", str(out),
               "--threads-per-rank", "1", "--timeout-s", "60", "--comm", "gloo"])
    assert rc == 0
    assert_train_equals_eager_sgd(out, *hf_llama(4, 8), 0.1, 3)
    import json

    placements = json.loads((out / "programs" / "plan.json").read_text())["param_placements"]
    assert placements["model.model.layers.0.mlp.down_proj.weight"] == ["S(1)"], placements


def test_backend_plan_tp_on_a_module_without_any_plan_says_what_to_pass():
    import torch
    import torch.nn as nn

    import adaptdist

    torch._dynamo.reset()
    f = torch.compile(nn.Sequential(nn.Linear(4, 4)), backend=adaptdist.backend(plan="tp"))
    with pytest.raises(Exception, match="Sequential carries none.*ManualPlan.parse"):
        f(torch.randn(2, 4))


def test_pipeline_stages_take_the_models_own_plan_for_a_tp_axis():
    """``--plan tp --mesh pp=2,tp=2`` (inner_plan) and ``--plan pp|auto --mesh pp=2,tp=2`` (mesh_preset) on a model
    file without TP_PLAN: the Hugging Face model's plan inside the stages; without a model, as before."""
    from pathlib import Path

    from adaptdist.cli.pipeline_flags import inner_plan
    from adaptdist.compiler.pipeline_lowering import mesh_preset
    from adaptdist.model_spec import ModelSpec

    spec = ModelSpec.parse(f"{Path(__file__).with_name('models.py')}:hf_llama")
    model = hf_llama()[0]
    for plan in ("tp", "pp"):
        inner = inner_plan(types.SimpleNamespace(plan=plan, mesh="pp=2,tp=2"), spec, model)
        assert inner.mesh_axes == ("tp",) and dict(inner.params)["model.model.layers.0.mlp.down_proj.weight"] == ("S(1)",)
    assert mesh_preset("pp=2,tp=2", spec.module()) is None  # no model: each stage's ILP places them
    with pytest.raises(UsageError, match="defines none"):
        inner_plan(types.SimpleNamespace(plan="tp", mesh="pp=2,tp=2"), spec)
