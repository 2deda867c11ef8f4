"""The pipeline parts wired together (issue 15, point 1): ``--plan pp`` / ``--mesh pp=N,...`` take the planner's
layer ranges, schedule and microbatches where the user sets none (and keep what the user sets); a pipeline
compile writes report.html with the stages and the predicted timeline; ``train --trace``'s predicted pipeline
timeline from the schedule and the stages' predicted F/B/W."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.cli import main
from adaptdist.compiler.capture import capture
from adaptdist.compiler.pipeline_auto import choose_pipeline_plan
from adaptdist.cost_models.hardware import FixedCluster
from adaptdist.runtime.trace_view import pipeline_actions, predicted_pipeline_of, stage_action_times

MODEL = str(Path(__file__).parent / "models.py") + ":tiny_gpt"
COMMON = ["--batch-size", "8", "--seq-len", "8"]


def _mlp(depth=6, width=64, batch=16):
    torch.manual_seed(0)
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))
    x = torch.randn(batch, width)
    return capture(model, (x, x), F.mse_loss)


def test_the_planner_chooses_what_the_user_leaves_open():
    cg = _mlp()
    cl = FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6)
    d = choose_pipeline_plan(cg, cl, 2)
    assert d.choice is not None and d.fixed == {}
    spec = d.plan.pipeline
    assert spec.schedule == d.choice.schedule and spec.microbatches == d.choice.microbatches
    assert all("forward" in s.predicted_s for s in spec.stages)
    text = "\n".join(d.lines())
    assert "chosen by the planner" in text and f"why {spec.schedule}" in text and "bubble" in text
    fixed = choose_pipeline_plan(cg, cl, 2, mesh="pp=2", microbatches=4, schedule="gpipe")
    assert fixed.plan.pipeline.schedule == "gpipe" and fixed.plan.pipeline.microbatches == 4
    assert fixed.fixed == {"stages": 2, "schedule": "gpipe", "microbatches": 4}


def test_a_faster_device_gets_more_layers_in_the_plan():
    cg = _mlp(depth=6, width=512, batch=64)
    cl = FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6)
    fast = dataclasses.replace(cl.devices[0], peak_flops={"float32": 1e11}, memory_bandwidth_bytes_per_s=2e10)
    hetero = dataclasses.replace(cl, devices=(fast, cl.devices[1]))
    stages = choose_pipeline_plan(cg, hetero, 2, schedule="1f1b", microbatches=8).plan.pipeline.stages
    assert len(stages[0].layers) > len(stages[1].layers)  # uneven: the first device is faster
    even = choose_pipeline_plan(cg, cl, 2, schedule="1f1b", microbatches=8).plan.pipeline.stages
    assert len(even[0].layers) == len(even[1].layers)


def test_no_pipeline_from_the_planner_falls_back_to_the_even_split_and_its_errors():
    from adaptdist.errors import AdaptdistError

    cg = _mlp(depth=2, batch=2)
    cl = FixedCluster.uniform([("h0", 2)])
    with pytest.raises(AdaptdistError, match="1 microbatches < 2 stages"):
        choose_pipeline_plan(cg, cl, 2, schedule="1f1b", microbatches=1)


def test_plan_pp_prints_the_planners_stage_plan(capsys):
    assert main(["plan", MODEL, *COMMON, "--plan", "pp", "--nproc", "2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline stages chosen by the planner" in text and "stage 0: layers" in text and "why " in text
    assert main(["plan", MODEL, *COMMON, "--plan", "pp", "--nproc", "2", "--schedule", "gpipe",
                 "--microbatches", "2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline mesh pp=2, schedule gpipe, 2 microbatches" in text and "set by you: schedule gpipe" in text


def test_stage_action_times_and_the_predicted_pipeline():
    assert stage_action_times({0: {"forward": 1.0, "backward": 2.0, "weight": 0.5}}) == {
        (0, "F"): 1.0, (0, "I"): 2.0, (0, "W"): 0.5, (0, "B"): 2.5}
    from adaptdist.plan import PipelineSpec, StageSpec

    t = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
    spec = PipelineSpec((StageSpec(("a",), {"dp": 2}, (0, 1), t), StageSpec(("b",), {"dp": 2}, (2, 3), t)), 2,
                        "gpipe", 1, {})
    acts = pipeline_actions(spec, 4)
    assert acts[0] == acts[1] and acts[2] == acts[3] and {a[0] for a in acts[2]} == {1}
    spans = predicted_pipeline_of(spec, 4)
    # GPipe, 2 stages x 2 microbatches of F 1 s and B 2 s: 2 F + the last stage's turn-around + 2 B = 1+2+2+2+... 
    assert max(s.end_s for s in spans) == pytest.approx(1 + 2 * 1 + 2 * 2 + 2)
    assert {s.rank for s in spans} == {0, 1, 2, 3}


@pytest.mark.slow
def test_compile_pp_writes_the_report_with_the_stages(tmp_path):
    import hashlib

    from adaptdist.stage_program_io import load_pipeline_program

    out = tmp_path / "art"
    assert main(["compile", MODEL, *COMMON, "--plan", "pp", "--nproc", "2", "-o", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "Pipeline stages" in html and "<svg" in html.split("Pipeline stages")[1]
    assert "report.html" in json.loads((out / "manifest.json").read_text())["files"]
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files["report.html"] == hashlib.sha256((out / "report.html").read_bytes()).hexdigest()
    assert load_pipeline_program(out, 1).schedule == json.loads((out / "plan.json").read_text())["pipeline"]["schedule"]


@pytest.mark.slow
def test_train_trace_of_a_pipeline_has_the_predicted_timeline(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", MODEL, *COMMON, "--plan", "pp", "--nproc", "2", "--steps", "2", "--out", str(out),
                 "--sample-bytes", "0", "--trace", "--threads-per-rank", "1", "--optimizer", "sgd",
                 "--timeout-s", "60"]) == 0
    text = "".join(capsys.readouterr())
    assert "no predicted timeline" not in text and "pipeline stages chosen by the planner" in text
    html = (out / "timeline.html").read_text()
    assert "Predicted (planner)" in html and "<h3>predicted</h3>" in html
    doc = json.loads((out / "trace.json").read_text())
    assert {1000, 1001} <= {e["pid"] for e in doc["traceEvents"] if e.get("ph") == "X"}  # predicted ranks 0, 1


def test_consider_pp_weighs_stages_in_auto(capsys):
    assert main(["plan", MODEL, *COMMON, "--nproc", "2", "--consider-pp"]) == 0
    text = capsys.readouterr().out
    assert "pipeline plan:" in text and "vs the best plan without stages" in text
    assert main(["plan", MODEL, *COMMON, "--nproc", "2"]) == 0
    assert "vs the best plan without stages" not in capsys.readouterr().out
