"""Ctrl-C at the last step (or while the last files are written) finishes the run instead of leaving it
'interrupted' with a suggested --resume that cannot work (the checkpoint is at --steps already)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from adaptdist.errors import RunInterruptedError

REPO = Path(__file__).parent.parent

MODEL = """
import os, signal
import torch, torch.nn as nn, torch.nn.functional as F
STEPS = 3
def f(batch_size, seq_len):
    torch.manual_seed(0)
    return nn.Linear(4, 3), (torch.randn(batch_size, 4), torch.randn(batch_size, 3)), F.mse_loss
def data(batch_size, seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        step += 1
        if step == STEPS and os.environ.get("RANK") == "0":
            os.killpg(os.getpgid(0), signal.SIGINT)  # Ctrl-C (the whole foreground group) during the last step
        yield torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, 3, generator=g)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_at_the_last_step_finishes_the_run(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(textwrap.dedent(MODEL))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "adaptdist.cli", "train", f"{model}:f", "--nproc", "2", "--plan",
                           "dp", "--batch-size", "4", "--steps", "3", "--out", str(out), "--sample-bytes", "0",
                           "--threads-per-rank", "1"], env=env, capture_output=True, text=True, timeout=170,
                          start_new_session=True)
    err = proc.stderr
    assert proc.returncode == 0, err
    assert "resume with" not in err and "trained 3 steps" in err, err
    assert json.loads((out / "run.json").read_text())["state"] == "complete"
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert (out / "model.safetensors").is_file()


def test_finished_anyway_takes_only_this_launchs_complete_result(tmp_path):
    from adaptdist.cli.train import finished_anyway

    console = types.SimpleNamespace(print=lambda *a, **k: None)
    e = RunInterruptedError("Ctrl-C", int(signal.SIGINT))
    f = tmp_path / "result.json"
    t0 = time.time() - 1
    f.write_text(json.dumps({"losses": [1.0, 0.9, 0.8]}))
    assert finished_anyway(e, tmp_path, 3, t0, console)["losses"] == [1.0, 0.9, 0.8]
    assert finished_anyway(e, tmp_path, 4, t0, console) is None  # a shorter run's result (resumed in place)
    assert finished_anyway(e, tmp_path, 3, time.time() + 10, console) is None  # written before this launch
    assert finished_anyway(RuntimeError("boom"), tmp_path, 3, t0, console) is None  # a failure, not an interrupt


def test_an_interrupt_after_the_last_checkpoint_does_not_suggest_a_plain_resume(tmp_path, monkeypatch, capsys):
    import adaptdist.runtime.checkpoint_store as store
    from adaptdist.cli.train import _ended_early

    monkeypatch.setattr(store, "latest_good", lambda root, note=None: types.SimpleNamespace(
        step=20, path=root / "step-00000020"))
    (tmp_path / "run.json").write_text(json.dumps({"version": 1, "state": "running", "settings": {}}))
    e = RunInterruptedError("Ctrl-C", int(signal.SIGINT))
    assert _ended_early(e, tmp_path, None, steps=20) == 130
    err = capsys.readouterr().err
    assert "after the last step (20)" in err and f"--resume {tmp_path} --steps N (N > 20)" in err, err
    assert _ended_early(e, tmp_path, None, steps=30) == 130
    err = capsys.readouterr().err
    assert f"at step 20, checkpoint at {tmp_path / 'checkpoints' / 'step-00000020'}; resume with: adaptdist train --resume {tmp_path}" \
        in err, err
