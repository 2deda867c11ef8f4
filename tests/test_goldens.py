"""Golden tests of code generation: for three fixed (model, cluster) pairs, the plan and every rank's
generated program must equal the files checked in under tests/goldens/, so an unintended change in
codegen (or in the planner's choice) shows up in review as a diff of those files.

Regenerate them, after checking the change is intended, with::

    .venv/bin/python -m pytest tests/test_goldens.py --update-goldens
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.calibrate.local import load_cluster
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.planner import plan_auto
from models import mlp, tiny_gpt, tiny_llama

GOLDENS = Path(__file__).parent / "goldens"


def _plan_text(plan) -> str:
    """The plan JSON without the graph fingerprint (it hashes torch's op names, which torch may rename)."""
    doc = json.loads(plan.to_json())
    doc.pop("graph_fingerprint")
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def _cases():
    def mlp_dp():
        model, batch, loss = mlp(7)
        return compile_model(model, batch, loss, 2, ManualPlan.parse("dp"))

    def gpt_dp_tp():
        import adaptdist.models.gpt as gpt_module

        model, batch, loss = tiny_gpt(4, 8)
        return compile_model(model, batch, loss, 4, ManualPlan.parse("dp,tp", gpt_module), mesh="dp=2,tp=2")

    def llama_auto():
        model, batch, loss = tiny_llama(8, 8)
        cluster = load_cluster(GOLDENS / "cluster_4cpu.yaml")
        captured = capture(model, batch, loss)
        plan = plan_auto(captured, cluster).plan
        return compile_model(model, batch, loss, 4, plan, captured=captured)

    return {"mlp_dp_2cpu": mlp_dp, "gpt_dp2_tp2_4cpu": gpt_dp_tp, "llama_auto_4cpu": llama_auto}


@pytest.mark.parametrize("case", sorted(_cases()))
def test_codegen_matches_golden(case, request):
    torch.manual_seed(0)
    programs = _cases()[case]()
    files = {"plan.json": _plan_text(programs[0].plan)}
    files.update({f"rank{r}.py": p.code for r, p in programs.items()})
    d = GOLDENS / case
    if request.config.getoption("--update-goldens"):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for name, text in files.items():
            (d / name).write_text(text)
        return
    assert d.is_dir(), f"no goldens for {case}: run pytest tests/test_goldens.py --update-goldens"
    assert sorted(p.name for p in d.iterdir()) == sorted(files), f"{case}: other files than the goldens"
    for name, text in files.items():
        want = (d / name).read_text()
        assert text == want, (f"{case}/{name} differs from tests/goldens/{case}/{name}; if the change is intended, "
                              "regenerate with --update-goldens and review the diff")
