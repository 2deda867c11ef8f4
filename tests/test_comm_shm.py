"""``--comm shm|gloo`` end to end: `adaptdist train`, `adaptdist compile` + `adaptdist run` (multi-process tests are
marked slow), and the refusal of shm artifacts where the kernels cannot be loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import adaptdist.kernels as kernels
from adaptdist.cli import main

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"shm kernels not built: {kernels.load_error()}")
STEPS, LR = 3, 2e-3
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("model") / "m.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        def factory(batch_size, seq_len):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
            g = torch.Generator().manual_seed(1)
            return model, (torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)), \\
                F.cross_entropy
    """))
    return f


def _eager(model_file: Path, factory: str = "factory"):
    """Single-process SGD on the whole batch: losses and final parameters."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shm_model", model_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, (x, y), loss_fn = getattr(mod, factory)(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def shm_artifacts(model_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "a"
    assert main(["compile", f"{model_file}:factory", "--nproc", "2", "--batch-size", "8", "--plan", "fsdp",
                 "--comm", "shm", "-o", str(out)]) == 0
    return out


def test_shm_artifacts_say_so_and_run_refuses_them_without_kernels(shm_artifacts):
    manifest = json.loads((shm_artifacts / "manifest.json").read_text())
    assert manifest["kernels"] == ["shm"] and manifest["transports"] == {"dp": "shm"}
    assert "torch.ops.adaptdist.shm_" in (shm_artifacts / "rank0" / "program.py").read_text()
    env = dict(os.environ, ADAPTDIST_KERNELS="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "adaptdist.cli", "run", str(shm_artifacts), "--steps", "1",
                           "--out", str(shm_artifacts.parent / "refused")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ShmUnavailableError" in proc.stderr or "shared-memory" in proc.stderr, proc.stderr[-2000:]
    assert "disabled by ADAPTDIST_KERNELS=0" in proc.stderr and "Compile it again with --comm gloo" in proc.stderr
    assert "--comm auto|gloo" not in proc.stderr  # (run has no --comm)
    assert not (shm_artifacts.parent / "refused" / "status").exists()  # no rank started


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_and_run_with_shm_equal_gloo_and_eager(model_file, shm_artifacts, tmp_path):
    """2 ranks, fsdp (all_gather, reduce_scatter, all_reduce): `train --comm shm`, `train --comm gloo` and `run` of
    the shm artifacts give eager's losses and SGD-updated parameters; summary.json names each axis's transport."""
    want_losses, want_params = _eager(model_file)
    common = ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR)]
    runs = {}
    for comm in ("shm", "gloo"):
        out = tmp_path / comm
        assert main(["train", f"{model_file}:factory", "--nproc", "2", "--batch-size", "8", "--plan", "fsdp",
                     "--comm", comm, "--sample-bytes", "0", "--out", str(out), *common]) == 0
        runs[comm] = out
    assert main(["run", str(shm_artifacts), "--out", str(tmp_path / "run"), *common]) == 0
    runs["run"] = tmp_path / "run"
    for name, out in runs.items():
        summary = json.loads((out / "summary.json").read_text())
        assert summary["transports"] == {"dp": "gloo" if name == "gloo" else "shm"}, name
        assert summary["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6), name
        if name != "run":  # (run writes the weights too, from the same code path)
            got = load_file(str(out / "model.safetensors"))
            for n, p in want_params.items():
                torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-5, msg=f"{name} {n}")


@pytest.mark.slow
def test_dp_buckets_flattened_into_registered_inputs_equal_eager(tmp_path):
    """2 ranks, dp, `--comm shm`: gradient buckets are flattened straight into the ranks' registered input regions
    (``shm_flatten_all_reduce_start``) and every one of them reads them in place (no copy-in),
    with eager's losses and SGD-updated parameters."""
    f = ROOT / "tests" / "models.py"  # wide_mlp: 5 MiB of gradients, several buckets over 256 KiB
    want_losses, want_params = _eager(f, "wide_mlp")
    out = tmp_path / "o"
    assert main(["train", f"{f}:wide_mlp", "--nproc", "2", "--batch-size", "8", "--plan", "dp", "--comm", "shm",
                 "--sample-bytes", "0", "--out", str(out), "--steps", str(STEPS), "--optimizer", "sgd",
                 "--lr", str(LR)]) == 0
    fused = (out / "programs" / "rank0" / "program.py").read_text().count("shm_flatten_all_reduce_start.default(")
    assert fused >= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transports"] == {"dp": "shm"}
    # every fused bucket reads its input in place (each its own output range), also while the 4 MiB weight's own
    # all_reduce (one tensor: copy-in; its output at the top of the region) is in flight beside them
    counts = summary["shm_all_reduce"]
    assert counts["in_place"] == fused * STEPS and counts["calls"] > counts["in_place"], counts
    assert summary["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    got = load_file(str(out / "model.safetensors"))
    for n, p in want_params.items():
        torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-5, msg=n)
