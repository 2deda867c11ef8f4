"""run_worker on pipeline programs (hand-built, saved as a program directory): losses and final weights equal eager,
and a pipeline checkpoint resumes under a data-parallel plan (resharded: pp -> dp) to eager's numbers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaptdist.compiler.lowering import compile_model
from adaptdist.program import save_programs
from adaptdist.runtime.launch import launch_local
from adaptdist.stage_program_io import is_pipeline_directory, load_pipeline_program, save_pipeline_programs
from adaptdist.runtime.worker import DataSpec, TrainConfig, run_worker
from pipeline_workers import D, Blocks, as_graph_modules, build_programs, mse

pytestmark = pytest.mark.slow  # starts ranks

LR, TOL, ROWS = 0.3, 1e-5, 8


def _cfg(program_dir, out, batch_file, steps) -> TrainConfig:
    return TrainConfig(program_dir=str(program_dir), out_dir=str(out), steps=steps, lr=LR, optimizer="sgd",
                       data=DataSpec(__file__, None, ROWS, 1, batch_file=str(batch_file)), progress=False,
                       timeout_s=60.0, model_name="blocks")


def test_pipeline_run_then_resume_under_dp(tmp_path):
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g))
    save_file({"b0": batch[0], "b1": batch[1]}, str(tmp_path / "batch.safetensors"))
    pp_dir = save_pipeline_programs(as_graph_modules(build_programs(2, 1, "1f1b", 2, ROWS, False)),
                                    tmp_path / "pp")
    assert is_pipeline_directory(pp_dir) and load_pipeline_program(pp_dir, 1, 2).stages[0].stage == 1
    out = tmp_path / "out"
    launch_local(run_worker, (_cfg(pp_dir, out, tmp_path / "batch.safetensors", 2),), 2)
    pp_result = json.loads((out / "result.json").read_text())

    model = Blocks(2, False)
    dp = compile_model(model, batch, mse, 2)
    dp_dir = save_programs(dp, tmp_path / "dp")
    launch_local(run_worker, (_cfg(dp_dir, out, tmp_path / "batch.safetensors", 4),), 2)  # resumes at step 2
    dp_result = json.loads((out / "result.json").read_text())

    eager = Blocks(2, False)
    opt = torch.optim.SGD(eager.parameters(), lr=LR)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = mse(eager(batch[0]), batch[1])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert pp_result["losses"] == pytest.approx(losses[:2], abs=TOL)
    assert dp_result["start_step"] == 2
    assert dp_result["losses"] == pytest.approx(losses, abs=TOL)
    weights = load_file(str(out / "model.safetensors"))
    for n, p in eager.named_parameters():
        torch.testing.assert_close(weights[n], p.detach(), atol=TOL, rtol=TOL, msg=n)
    resumed = [e for e in dp_result["events"] if e["event"] == "resume"]
    assert resumed and "schedule 1f1b" in resumed[0]["saved_plan"], resumed
