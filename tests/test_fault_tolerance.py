"""Faults injected into `adaptdist train` (gloo, 2-3 ranks, small GPT): every one recovers from the newest good
checkpoint and ends with the parameters of a run that had no fault. The 50-fault sweep is
benchmarks/bench_faults.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adaptdist.cli import main

pytestmark = pytest.mark.slow  # every test here starts ranks

SMALL = ["--batch-size", "4", "--seq-len", "16", "--threads-per-rank", "1", "--sample-bytes", "0",
         "--optimizer", "sgd", "--lr", "0.05", "--plan", "dp"]
STEPS = 8


def _train(out: Path, *extra: str, steps: int = STEPS, env: dict | None = None, monkeypatch=None) -> int:
    if env and monkeypatch is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    try:
        return main(["train", "--steps", str(steps), "--out", str(out), "--checkpoint-every", "2", *SMALL, *extra])
    finally:
        if env and monkeypatch is not None:
            for k in env:
                monkeypatch.delenv(k)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def _assert_equal_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        if atol == 0.0:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A run with no fault: 8 SGD steps on 2 ranks."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(["train", "--steps", str(STEPS), "--out", str(out), "--checkpoint-every", "2", *SMALL]) == 0
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["kill", pytest.param("raise", marks=pytest.mark.bench)])  # raise: also below
def test_a_dead_rank_restarts_every_rank_from_the_last_checkpoint(reference, tmp_path, monkeypatch, kind):
    out = tmp_path / "run"
    rc = _train(out, "--max-restarts", "1", env={"ADAPTDIST_INJECT_FAULT": f"{kind}:1:5"}, monkeypatch=monkeypatch)
    assert rc == 0
    _assert_equal_weights(out, reference)  # bitwise: the same plan, the same data, the same optimizer state
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and len(summary["restarts"]) == 1
    assert "rank 1" in summary["restarts"][0]["cause"]
    assert summary["resumes"][0]["step"] == 4  # checkpoints every 2 steps; the fault came before step 5
    ref = json.loads((reference / "summary.json").read_text())
    assert summary["losses"] == ref["losses"]  # the loss curve has no jump: it is the fault-free one


@pytest.mark.timeout(240)
def test_a_stalled_rank_is_named_and_the_job_recovers(reference, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    t0 = time.monotonic()
    rc = _train(out, "--max-restarts", "1", "--collective-timeout-s", "5",
                env={"ADAPTDIST_INJECT_FAULT": "stall:1:3"}, monkeypatch=monkeypatch)
    assert rc == 0 and time.monotonic() - t0 < 200
    _assert_equal_weights(out, reference)
    cause = json.loads((out / "summary.json").read_text())["restarts"][0]["cause"]
    assert "rank 1" in cause and "did not arrive" in cause, cause


@pytest.mark.timeout(240)
def test_past_its_restarts_a_run_says_how_to_resume_and_resume_finishes_it(reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    rc = _train(out, env={"ADAPTDIST_INJECT_FAULT": "raise:0:6"}, monkeypatch=monkeypatch)
    assert rc == 2
    err = capsys.readouterr().err
    assert "rank 0" in err and f"adaptdist train --resume {out}" in err and "step-00000004" in err
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()
    assert main(["train", "--resume", str(out)]) == 0
    _assert_equal_weights(out, reference)
    assert json.loads((out / "run.json").read_text())["state"] == "complete"


@pytest.mark.timeout(240)
def test_resume_refuses_a_changed_setting(reference, tmp_path, capsys):
    assert main(["train", "--resume", str(reference), "--lr", "0.1", "--out", str(tmp_path / "x")]) == 2
    assert "--lr was 0.05 there, not 0.1" in capsys.readouterr().err


@pytest.mark.timeout(600)  # alone (-k), the module's fault-free run is made inside it too
def test_sigterm_to_the_launcher_checkpoints_then_resume_with_more_steps(reference, tmp_path):
    """SIGTERM (a preemption notice) to `adaptdist train`: one line, exit 143, a checkpoint after the step the
    ranks agreed on; --resume --steps K then ends equal, bitwise, to a run of K steps that never stopped (the
    module's fault-free run, K = 8, unless the stop came at step 8 or later: then a run of its own)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "adaptdist.cli", "train", "--steps", "100000", "--out", str(out),
           "--checkpoint-every", "100000", *SMALL]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    # Signal once rank 0 has logged a finished step (its first "step 1/N" line), not after a fixed sleep: on a
    # loaded machine the first step may take longer than any fixed wait.
    lines: list[str] = []
    stepped = threading.Event()

    def read_stderr():
        for line in p.stderr:
            lines.append(line)
            if line.startswith("step ") and not stepped.is_set():
                stepped.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert stepped.wait(timeout=200), "".join(lines)[-3000:]
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    reader.join(timeout=30)
    err = "".join(lines)
    assert p.returncode == 143, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("adaptdist: interrupted (SIGTERM) at step"), err[-3000:]
    assert f"resume with: adaptdist train --resume {out}" in last
    assert "Traceback" not in err, err[-3000:]
    assert json.loads((out / "run.json").read_text())["state"] == "interrupted"
    from adaptdist.runtime.checkpoint_store import latest_good

    stopped_at = latest_good(out / "checkpoints").step
    assert stopped_at >= 1 and f"at step {stopped_at}," in last
    total = STEPS if stopped_at < STEPS else stopped_at + 3
    assert main(["train", "--resume", str(out), "--steps", str(total)]) == 0
    ref = reference
    if total != STEPS:  # checkpoints change no weight: the fault-free run's interval (2) is no difference
        ref = tmp_path / "ref"
        assert main(["train", "--steps", str(total), "--out", str(ref), "--checkpoint-every", "100000", *SMALL]) == 0
    _assert_equal_weights(out, ref)
    assert json.loads((out / "summary.json").read_text())["losses"] == json.loads((ref / "summary.json").read_text())["losses"]


@pytest.mark.timeout(300)
def test_an_elastic_job_that_loses_a_rank_replans_and_goes_on(reference, tmp_path, monkeypatch):
    """--nproc 2:3 (one agent per rank): rank 2's agent dies before step 5; ranks 0 and 1 re-form at world size 2,
    re-plan (cached for 2 ranks), load the step-4 checkpoint resharded and finish: the parameters equal the 2-rank
    fault-free run's to 1e-5 (steps 1-4 were summed over 3 ranks)."""
    out = tmp_path / "run"
    rc = _train(out, "--nproc", "2:3", "--max-restarts", "1", env={"ADAPTDIST_INJECT_FAULT": "lose-node:2:5"},
                monkeypatch=monkeypatch)
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == STEPS
    resume = summary["resumes"][0]
    assert (resume["saved_world_size"], resume["world_size"], resume["step"]) == (3, 2, 4)
    assert "rank 2" in summary["restarts"][0]["cause"]
    assert list((out / "programs_cache").glob("world2-*/manifest.json"))
    _assert_equal_weights(out, reference, atol=1e-5)


@pytest.mark.timeout(300)
def test_resume_on_another_world_size_reshards_and_continues(reference, tmp_path):
    """Stopped at step 4 on 2 ranks (the fault-free run without its later checkpoints), resumed on 3 (re-planned,
    resharded): the loss curve has no jump and the parameters end equal, to 1e-5, to the 2-rank run's (the sums
    over the batch differ in order only)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for d in (out / "checkpoints").glob("step-*"):
        if int(d.name.split("-")[1]) > 4:
            shutil.rmtree(d)
    for name in ("model.safetensors", "summary.json"):  # what the resumed run must write again
        (out / name).unlink()
    assert main(["train", "--resume", str(out), "--steps", str(STEPS), "--nproc", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert summary["resumes"][0]["saved_world_size"] == 2 and summary["resumes"][0]["world_size"] == 3
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    _assert_equal_weights(out, reference, atol=1e-5)


@pytest.mark.timeout(240)
def test_asynchronous_checkpoints_resume_like_synchronous_ones(reference, tmp_path, monkeypatch):
    """--async-checkpoint: checkpoints written in a thread and committed at the next one; a rank killed before
    step 7 resumes from the newest committed one and ends bitwise equal to the fault-free run."""
    out = tmp_path / "run"
    rc = _train(out, "--async-checkpoint", "--max-restarts", "1", env={"ADAPTDIST_INJECT_FAULT": "kill:1:7"},
                monkeypatch=monkeypatch)
    assert rc == 0
    _assert_equal_weights(out, reference)
    resumed = json.loads((out / "summary.json").read_text())["resumes"][0]["step"]
    assert resumed in (4, 6)  # step 6's was in flight or committed when the rank died; never a partial one


@pytest.mark.timeout(240)
def test_an_asynchronous_checkpoint_never_committed_is_named_on_restart(tmp_path, monkeypatch, capfd):
    """New-user report: 'step 4/8: checkpoint .../step-00000004' was printed, a rank died at step 5, and the restart
    resumed from step 2 with no word why. Now step 4's line says it is being written (committed at the next
    checkpoint), and the restart says step 4's write was interrupted before its commit."""
    out = tmp_path / "run"
    monkeypatch.setenv("COLUMNS", "1000")  # the ranks' log lines unwrapped
    rc = _train(out, "--async-checkpoint", "--max-restarts", "1", env={"ADAPTDIST_INJECT_FAULT": "kill:1:5"},
                monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    assert rc == 0, err[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumes"][0]["step"] == 2
    ckpts = out / "checkpoints"
    assert f"step 4/8: writing checkpoint {ckpts / 'step-00000004'} in the background" in err, err[-3000:]
    assert f"step 4/8: checkpoint {ckpts / 'step-00000002'} committed" in err, err[-3000:]
    assert f"step 4/8: checkpoint {ckpts / 'step-00000004'}\n" not in err, err[-3000:]
    assert ("checkpoint step-00000004 was not complete (its write was interrupted before its commit; an "
            "asynchronous checkpoint is committed at the next checkpoint): resuming from step-00000002 (step 2)"
            ) in err, err[-3000:]


@pytest.mark.bench  # outside CI (-m bench): a LLaMA run of its own; the refusal itself: test_checkpoint_store.py
@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_is_refused_before_launch(reference, tmp_path, capsys):
    """A LLaMA run whose checkpoints were replaced by the GPT's: --resume stops before launching any rank, with
    one error naming both models (restarting could not help)."""
    import shutil

    out = tmp_path / "llama"
    assert main(["train", "builtin:llama", "--steps", "2", "--out", str(out), "--checkpoint-every", "2", *SMALL]) == 0
    shutil.rmtree(out / "checkpoints")
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "12"]) == 2
    err = capsys.readouterr().err
    assert "CheckpointError" in err and "'builtin:gpt', not 'builtin:llama'" in err, err[-2000:]
    assert "rank 0: pid" not in err  # nothing was launched


@pytest.mark.timeout(120)
def test_resume_with_no_usable_checkpoint_stops_and_changes_nothing(reference, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for d in (out / "checkpoints").iterdir():
        f = d / "dcp" / "__0_0.distcp"
        b = bytearray(f.read_bytes())
        b[100] ^= 1
        f.write_bytes(bytes(b))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert main(["train", "--resume", str(out), "--steps", "12"]) == 2
    err = capsys.readouterr().err
    assert "none of its 3 checkpoints is usable" in err and "nothing was changed" in err, err[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "model.safetensors").is_file() and json.loads((out / "run.json").read_text())["state"] == "complete"
    assert main(["train", "--resume", str(reference), "--steps", str(STEPS)]) == 2  # at step 8 already
    assert "is at step 8 already" in capsys.readouterr().err


def test_a_running_runs_directory_is_locked(tmp_path):
    from adaptdist.cli.train import lock_out_dir
    from adaptdist.errors import UsageError

    held = lock_out_dir(tmp_path)
    with pytest.raises(UsageError, match=rf"in use by another adaptdist run \(pid {os.getpid()}\)"):
        lock_out_dir(tmp_path)
    held.close()
    lock_out_dir(tmp_path).close()  # free again once the holder is gone


@pytest.mark.timeout(420)
def test_an_elastic_pipeline_that_loses_a_rank_replans_its_stages_and_goes_on(reference, tmp_path, monkeypatch):
    """--plan pp --nproc 2:3: the planner's stages over 3 ranks; rank 2's agent dies before step 5; ranks 0 and 1 re-form, re-plan a 2-stage
    pipeline through the elastic door (ProgramSource, cached for 2 ranks), load the step-4 checkpoint (each rank its
    new stage's layers) and finish: losses and parameters equal the fault-free 2-rank data-parallel run's (itself
    eager's) to 1e-5."""
    out = tmp_path / "run"
    rc = _train(out, "--plan", "pp", "--schedule", "gpipe", "--microbatches", "2", "--nproc", "2:3",
                "--max-restarts", "1", env={"ADAPTDIST_INJECT_FAULT": "lose-node:2:5"}, monkeypatch=monkeypatch)
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == STEPS
    resume = summary["resumes"][0]
    assert (resume["saved_world_size"], resume["world_size"], resume["step"]) == (3, 2, 4)
    assert "rank 2" in summary["restarts"][0]["cause"]
    first = json.loads((out / "programs" / "manifest.json").read_text())
    # the planner's stages over 3 ranks: {2, 1} (stages of different sizes) or 3 one-rank stages
    assert first["kind"] == "pipeline" and first["world_size"] == 3 and first["mesh"]["pp"] >= 2, first
    [cached] = list((out / "programs_cache").glob("world2-*/manifest.json"))
    assert json.loads(cached.read_text())["kind"] == "pipeline" and json.loads(cached.read_text())["mesh"] == {"pp": 2}
    ref = json.loads((reference / "summary.json").read_text())
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    _assert_equal_weights(out, reference, atol=1e-5)
