"""`adaptdist compile` artifacts: what is written, the checks before running, and `adaptdist run`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from adaptdist.cli import main
from adaptdist.calibrate.local import load_cluster, local_cluster
from adaptdist.errors import ProgramLoadError
from adaptdist.program import check_artifacts


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
    return f"{f}:factory"


@pytest.fixture(scope="module")
def artifacts(model_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "a"
    assert main(["compile", model_file, "--nproc", "2", "--batch-size", "8", "--plan", "fsdp", "-o", str(out)]) == 0
    return out


def test_compile_writes_every_file_with_its_hash(artifacts):
    manifest = json.loads((artifacts / "manifest.json").read_text())
    for key in ("format_version", "adaptdist_version", "torch_version", "world_size", "mesh", "cluster_fingerprint"):
        assert key in manifest
    files = set(manifest["files"])
    for r in range(2):
        assert {f"rank{r}/program.py", f"rank{r}/graph.txt", f"rank{r}/shards.json", f"rank{r}/state.safetensors"} <= files
    assert {"plan.json", "report.html", "example_batch.safetensors"} <= files
    shards = json.loads((artifacts / "rank1" / "shards.json").read_text())
    assert shards["0.weight"] == {"global_shape": [64, 16], "placements": {"dp": "S(0)"}, "ranges": [[32, 64], [0, 16]]}
    report = (artifacts / "report.html").read_text()
    assert report.count("<svg") == 3 and "Predicted time and memory per rank" in report
    assert "# " in (artifacts / "rank0" / "program.py").read_text()  # local shapes as comments


def test_check_passes_on_the_cluster_compiled_for(artifacts):
    assert check_artifacts(artifacts, local_cluster(2))["world_size"] == 2


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_file_is_named(artifacts, tmp_path):
    d = _copy(artifacts, tmp_path / "a")
    (d / "rank1" / "graph.txt").unlink()
    with pytest.raises(ProgramLoadError, match=r"rank1/graph\.txt.*missing"):
        check_artifacts(d, local_cluster(2))


def test_edited_program_fails_its_hash(artifacts, tmp_path):
    d = _copy(artifacts, tmp_path / "a")
    p = d / "rank0" / "program.py"
    p.write_text(p.read_text() + "\n# edited\n")
    with pytest.raises(ProgramLoadError, match=r"rank0/program\.py.*sha256"):
        check_artifacts(d, local_cluster(2))


@pytest.mark.parametrize("field,value,message", [
    ("format_version", 999, "format version 999"),
    ("torch_version", "1.0.0", "torch 1.0.0"),
])
def test_version_mismatch_is_named(artifacts, tmp_path, field, value, message):
    d = _copy(artifacts, tmp_path / "a")
    m = json.loads((d / "manifest.json").read_text())
    m[field] = value
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ProgramLoadError, match=message):
        check_artifacts(d, local_cluster(2))


def test_world_size_and_topology_mismatch(artifacts, tmp_path):
    with pytest.raises(ProgramLoadError, match="compiled for 2 ranks, this cluster has 4"):
        check_artifacts(artifacts, local_cluster(4))
    cfile = tmp_path / "c.yaml"
    cfile.write_text(textwrap.dedent("""
        schema_version: 1
        hosts:
          - {name: a, device_kind: cpu, num_devices: 1}
          - {name: b, device_kind: cpu, num_devices: 1}
    """))
    with pytest.raises(ProgramLoadError, match="another cluster topology"):
        check_artifacts(artifacts, load_cluster(cfile))


@pytest.fixture(scope="module")
def run_of_6_steps(artifacts, tmp_path_factory) -> Path:
    """`adaptdist run` of the artifacts, 6 SGD steps, a checkpoint every 2 (one launch for the two tests below)."""
    out = tmp_path_factory.mktemp("run6") / "r"
    assert main(["run", str(artifacts), "--steps", "6", "--optimizer", "sgd", "--checkpoint-every", "2",
                 "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_run_trains_and_matches_train(run_of_6_steps, model_file, tmp_path):
    """`adaptdist run` on the artifacts gives the same losses as `adaptdist train` with the same plan (its first
    3 steps: checkpoints change no weight)."""
    run = json.loads((run_of_6_steps / "summary.json").read_text())["losses"][:3]
    assert main(["train", model_file, "--nproc", "2", "--batch-size", "8", "--plan", "fsdp", "--steps", "3",
                 "--optimizer", "sgd", "--lr", "2e-3", "--out", str(tmp_path / "t"), "--sample-bytes", "0"]) == 0
    train = json.loads((tmp_path / "t" / "summary.json").read_text())["losses"]
    assert run == pytest.approx(train, rel=1e-6)


def test_run_refuses_a_tampered_directory_with_exit_code_2(artifacts, tmp_path, capsys):
    d = _copy(artifacts, tmp_path / "a")
    (d / "plan.json").write_text("{}")
    assert main(["run", str(d), "--steps", "1"]) == 2
    assert "plan.json" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_entry_runs_the_artifacts(artifacts, tmp_path):
    """The multi-host path: each rank started by torchrun checks and runs the artifacts."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m",
                           "adaptdist.runtime.run_artifacts", str(artifacts), "--steps", "2", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "o" / "model.safetensors").is_file()


@pytest.mark.slow
def test_compile_writes_the_programs_train_runs(tmp_path):
    """`adaptdist compile` and `adaptdist train` lower with the same LoweringOptions defaults (one gradient
    bucket size), so for the same model, ranks and plan they write identical rank programs. The model's
    5 MiB of gradients fill several of the default 2 MiB buckets (25 MiB, the old compile default, would be one)."""
    common = [f"{Path(__file__).parent / 'models.py'}:wide_mlp", "--nproc", "2", "--batch-size", "4", "--plan", "dp"]
    assert main(["compile", *common, "-o", str(tmp_path / "compiled")]) == 0
    assert main(["train", *common, "--steps", "1", "--sample-bytes", "0", "--out", str(tmp_path / "trained")]) == 0
    for r in range(2):
        compiled = (tmp_path / "compiled" / f"rank{r}" / "program.py").read_text()
        trained = (tmp_path / "trained" / "programs" / f"rank{r}" / "program.py").read_text()
        assert compiled == trained, f"rank {r}: compile and train lowered different programs"
        metas = [json.loads((d / f"rank{r}" / "program.json").read_text())
                 for d in (tmp_path / "compiled", tmp_path / "trained" / "programs")]
        assert all(len(m.pop("compile_id")) == 64 for m in metas)  # the ids differ: compile's manifest has more fields
        assert metas[0] == metas[1]
    assert compiled.count("all_reduce") > 1  # several gradient buckets: the bucket size is part of what agrees
    assert (tmp_path / "compiled" / "plan.json").read_text() == (tmp_path / "trained" / "programs" / "plan.json").read_text()


@pytest.mark.slow
def test_run_resumes_from_its_checkpoint(artifacts, run_of_6_steps, tmp_path, monkeypatch):
    """`adaptdist run` killed past its restarts, then `--resume`: it continues from the newest good checkpoint and
    ends with the losses of a run that never stopped."""
    ref, out = run_of_6_steps, tmp_path / "r"
    args = ["--optimizer", "sgd", "--checkpoint-every", "2"]
    monkeypatch.setenv("ADAPTDIST_INJECT_FAULT", "raise:1:4")
    assert main(["run", str(artifacts), "--steps", "6", *args, "--out", str(out)]) == 2
    monkeypatch.delenv("ADAPTDIST_INJECT_FAULT")
    assert main(["run", str(artifacts), "--out", str(out), "--resume", "--lr", "0.5"]) == 2  # not the run's
    assert main(["run", str(artifacts), "--out", str(out), "--resume"]) == 0  # its steps, optimizer, interval
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumes"][0]["step"] == 2
    assert summary["losses"] == json.loads((ref / "summary.json").read_text())["losses"]


@pytest.mark.slow
def test_a_clean_resume_is_no_restart(artifacts, run_of_6_steps, tmp_path, capfd):
    """`run --steps 2`, then `--resume --steps 4` and `--resume --steps 6`: no launch is a restart (summary.json's
    restarts stay empty and no rank says "(restart N)"; each resume was counted as one), and the losses are those of
    a run that never stopped."""
    out = tmp_path / "r"
    assert main(["run", str(artifacts), "--steps", "2", "--optimizer", "sgd", "--checkpoint-every", "2",
                 "--out", str(out)]) == 0
    for steps in (4, 6):
        capfd.readouterr()
        assert main(["run", str(artifacts), "--steps", str(steps), "--out", str(out), "--resume"]) == 0
        err = capfd.readouterr().err
        assert "rank 0: pid" in err and "(restart" not in err and "adaptdist: restart" not in err, err
        summary = json.loads((out / "summary.json").read_text())
        assert summary["restarts"] == [] and summary["resumes"][-1]["step"] == steps - 2
    assert summary["losses"] == json.loads((run_of_6_steps / "summary.json").read_text())["losses"]


def test_run_notices_a_changed_model_file(artifacts, tmp_path, capsys):
    """The manifest holds the model file's sha256: an edited file (its data() feeds the run) is refused."""
    d = _copy(artifacts, tmp_path / "a")
    manifest = json.loads((d / "manifest.json").read_text())
    model = tmp_path / "m.py"
    model.write_text(Path(manifest["model_file"]).read_text() + "\n# edited\n")
    manifest["model_file"] = str(model)
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(d), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "changed since" in err and "m.py" in err
