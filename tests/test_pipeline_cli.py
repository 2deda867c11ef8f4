"""The pipeline flags end to end: ``train --plan pp`` (summary.json's losses = eager's), ``--resume`` of a pipeline
run, ``compile --mesh pp=2,tp=2`` + ``run`` (+ ``--resume``), ``plan --plan pp``, and the flags' clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptdist.cli.main import main
from models import tiny_gpt

MODEL = str(Path(__file__).parent / "models.py") + ":tiny_gpt"
B, T, LR = 8, 8, 0.1
COMMON = ["--batch-size", str(B), "--seq-len", str(T)]
TRAIN = [*COMMON, "--optimizer", "sgd", "--lr", str(LR), "--sample-bytes", "0", "--threads-per-rank", "1"]


def _eager_losses(steps: int) -> list[float]:
    model, (x, y), loss_fn = tiny_gpt(B, T)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        out.append(loss.item())
        opt.step()
    return out


def _losses(out: Path) -> list[float]:
    return json.loads((out / "summary.json").read_text())["losses"]


@pytest.mark.slow
def test_train_pp_then_resume_on_more_ranks_equals_eager(tmp_path):
    out = tmp_path / "run"
    assert main(["train", MODEL, *TRAIN, "--plan", "pp", "--nproc", "2", "--schedule", "gpipe", "--microbatches",
                 "2", "--steps", "2", "--out", str(out)]) == 0
    eager = _eager_losses(3)
    assert _losses(out) == pytest.approx(eager[:2], abs=1e-5)
    assert json.loads((out / "programs" / "manifest.json").read_text())["kind"] == "pipeline"
    assert not list((out / "programs").rglob("*.pt")) and (out / "model.safetensors").is_file()  # nothing pickled
    # resumed on 4 ranks: 4 stages instead of 2, each rank loading its new layers from the checkpoint
    assert main(["train", "--resume", str(out), "--nproc", "4", "--steps", "3", "--sample-bytes", "0"]) == 0
    assert _losses(out) == pytest.approx(eager, abs=1e-5)
    assert json.loads((out / "run.json").read_text())["settings"]["schedule"] == "gpipe"  # restored
    assert json.loads((out / "summary.json").read_text())["ranks"] == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_pp_dp_on_shared_memory_equals_eager(tmp_path):
    """pp=2,dp=2 on one host under --comm auto: the data-parallel peers' gradient all-reduces (and the tied
    embedding's, over both stages) go through the shared-memory kernels, sends and receives between the stages through
    gloo; losses and SGD-updated weights equal eager's; summary.json and the programs' manifest say so."""
    import adaptdist.kernels as kernels
    from safetensors.torch import load_file

    if not kernels.available():
        pytest.skip(f"the shm kernels are not built here: {kernels.load_error()}")
    out = tmp_path / "run"
    assert main(["train", MODEL, *TRAIN, "--plan", "pp", "--mesh", "pp=2,dp=2", "--nproc", "4", "--schedule", "1f1b",
                 "--microbatches", "2", "--steps", "2", "--comm", "auto", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transports"] == {"pp": "gloo", "dp": "shm"}
    manifest = json.loads((out / "programs" / "manifest.json").read_text())
    assert manifest["kernels"] == ["shm"] and manifest["transports"] == {"pp": "gloo", "dp": "shm"}
    rank2 = json.loads((out / "programs" / "rank2" / "program.json").read_text())
    assert rank2["shm_groups"] == {"adaptdist:dp[2,3]": [2, 3], "adaptdist:grads[0,1,2,3]": [0, 1, 2, 3]}
    assert summary["losses"] == pytest.approx(_eager_losses(2), abs=1e-5)
    model, (x, y), loss_fn = tiny_gpt(B, T)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    weights = load_file(str(out / "model.safetensors"))
    for n, p in model.named_parameters():
        torch.testing.assert_close(weights[n], p.detach(), atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.slow
def test_compile_pp_tp_then_run_and_resume_equals_eager(tmp_path):
    """Tensor parallelism inside the stages: sharded checkpoints resume, the full weights are put together."""
    model_file = tmp_path / "m.py"  # tiny_gpt with the built-in GPT's TP_PLAN
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          "from models import tiny_gpt  # noqa: F401\nfrom adaptdist.models.gpt import TP_PLAN  # noqa\n")
    art, out = tmp_path / "art", tmp_path / "run"
    assert main(["compile", f"{model_file}:tiny_gpt", *COMMON, "--plan", "tp", "--mesh", "pp=2,tp=2",
                 "--microbatches", "2", "--schedule", "gpipe", "-o", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kind"] == "pipeline" and manifest["mesh"] == {"pp": 2, "tp": 2} and "rank3/program.py" in manifest["files"]
    import adaptdist.kernels as kernels

    if kernels.available():  # --comm auto, one host: the stages' tp collectives are the shm kernels' ops
        assert manifest["transports"] == {"pp": "gloo", "tp": "shm"} and manifest["kernels"] == ["shm"]
        assert "torch.ops.adaptdist.shm_all_reduce.default(" in (art / "rank0" / "program.py").read_text()
    run = ["run", str(art), "--optimizer", "sgd", "--lr", str(LR), "--out", str(out)]
    assert main([*run, "--steps", "2"]) == 0
    assert main([*run, "--steps", "3", "--resume"]) == 0
    assert _losses(out) == pytest.approx(_eager_losses(3), abs=1e-5)
    model, (x, y), loss_fn = tiny_gpt(B, T)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(dict(model.named_parameters()))
    for n, p in model.named_parameters():
        torch.testing.assert_close(weights[n], p.detach(), atol=1e-5, rtol=1e-5, msg=n)


def test_plan_pp_prints_the_stages(capsys):
    assert main(["plan", MODEL, *COMMON, "--plan", "pp", "--nproc", "2", "--microbatches", "4", "--schedule", "1f1b"]) == 0
    text = capsys.readouterr().out
    assert "pipeline mesh pp=2, schedule 1f1b, 4 microbatches" in text
    assert "stage 0 on rank 0: tok_emb, pos_emb, blocks.0" in text and "stage 1 on rank 1" in text


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "2", "--plan", "dp"], "--microbatches sets a pipeline plan's microbatches; add --plan pp"),
    (["--plan", "pp", "--schedule", "1f1b", "--microbatches", "1"], "1 microbatches < 2 stages"),
])
def test_bad_pipeline_flags_are_clear_errors(argv, message, capsys):
    assert main(["plan", MODEL, *COMMON, "--nproc", "2", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{"plan": "pp"}, {"mesh": "pp=2,dp=1"}])
def test_the_torch_compile_backend_refuses_pipeline_plans(kwargs):
    import adaptdist
    from adaptdist.errors import UsageError

    with pytest.raises(UsageError, match="does not run pipeline plans.*adaptdist train --plan pp"):
        adaptdist.backend(**kwargs)
