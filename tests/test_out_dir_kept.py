"""A command that fails leaves the previous run in --out whole: everything that can be checked is checked first
(arguments and pass names at parsing, --mesh axis names, the data source, the model factory, the plan and the
compile), and the previous run is replaced only once the new one is about to write."""

from __future__ import annotations

import json
import textwrap

import pytest

from adaptdist.cli import main

MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F
def f(batch_size, seq_len):
    torch.manual_seed(0)
    return nn.Linear(4, 3), (torch.randn(batch_size, 4), torch.randn(batch_size, 3)), F.mse_loss
"""
DATA = """
def data(batch_size, seq_len, path=None, seed=0):
    while True:
        yield torch.randn(batch_size + 1, 4), torch.randn(batch_size + 1, 3)
"""


def _previous_run(out):
    """What a complete run leaves (its files' contents stand in for the real ones)."""
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / "meta.json").write_text('{"step": 2}')
    (out / "programs").mkdir()
    (out / "model.safetensors").write_bytes(b"weights of the previous run")
    (out / "summary.json").write_text('{"steps": 2}')
    (out / "run.json").write_text(json.dumps({"version": 1, "state": "complete", "settings": {}}))
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _files(out):
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


def _model(tmp_path, body=MODEL):
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent(body))
    return str(f)


@pytest.mark.parametrize("case", ["data_without_data_fn", "bad_first_batch", "unplannable", "bad_mesh_axis",
                                  "bad_pass"])
def test_a_failing_train_leaves_the_previous_run_whole(capsys, tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    before = _previous_run(out)
    model = _model(tmp_path, MODEL + DATA if case == "bad_first_batch" else MODEL)
    extra = {"data_without_data_fn": ["--data", str(tmp_path / "x.txt")],
             "bad_first_batch": [],
             "unplannable": ["--plan", "tp"],  # no TP_PLAN in the model file
             "bad_mesh_axis": ["--mesh", "foo=2"],
             "bad_pass": ["--disable-pass", "bogus"]}[case]
    argv = ["train", f"{model}:f", "--nproc", "2", "--batch-size", "6", "--steps", "2", "--out", str(out),
            "--sample-bytes", "0", *extra]
    if case == "bad_pass":
        with pytest.raises(SystemExit) as e:  # argparse, before anything runs
            main(argv)
        assert e.value.code == 2
    else:
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "replacing it" not in err and "Traceback" not in err, err
    assert _files(out) == before, err
    want = {"data_without_data_fn": "defines no data(", "bad_first_batch": "for step 1, batch element 0 as float32 [7, 4]",
            "unplannable": "TP_PLAN", "bad_mesh_axis": "mesh axis 'foo' means nothing",
            "bad_pass": "cannot skip 'bogus' (not a lowering pass)"}[case]
    assert want in err, err


def test_pass_names_are_checked_at_parsing(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "-o", "/nonexistent/never-made", "--disable-pass", "localize_indices"])
    err = capsys.readouterr().err
    assert "cannot skip 'localize_indices' (sharding rules rely on it" in err and "bucket_grad_allreduce" in err, err
    from adaptdist.cli.main import build_parser

    args = build_parser().parse_args(["train", "--disable-pass", "relax_views", "--disable-pass", "combine_partial_sums"])
    assert args.disable_pass == ["relax_views", "combine_partial_sums"]


@pytest.mark.parametrize("mesh, plan, bad", [
    ("foo=2", None, "'foo'"), ("dp=2,foo=2", "auto", "'foo'"), ("ep=2", "auto", "--plan ep"),
    ("tp=2", "dp", "'tp'"), ("dp=2", "ep", "'dp'"), ("pp=2,tp2=2", "pp", "'tp2'"),
    ("dp=2", "dp", None), ("dp=2,tp=2", "auto", None), ("tp3=4", None, None), ("dp=2,tp=2", "dp,tp", None),
    ("pp=2,dp=2", "auto", None), ("pp=2,dp=2", "dp", None), ("ep=2", "ep", None), ("dp=2", "fsdp", None),
    ("foo=2", "plan.yaml", None),  # a plan file names its own axes (checked when it is read)
])
def test_mesh_axes_must_mean_something_to_the_plan(mesh, plan, bad):
    from adaptdist.cli.mesh_axes import check_mesh_axes
    from adaptdist.errors import UsageError

    if bad is None:
        check_mesh_axes(mesh, plan)
        return
    with pytest.raises(UsageError, match="means nothing to this plan") as e:
        check_mesh_axes(mesh, plan)
    assert bad in str(e.value)


def test_the_preset_axes_are_the_presets_own():
    import types

    from adaptdist.annotations import ManualPlan
    from adaptdist.cli.mesh_axes import PRESET_AXES

    module = types.SimpleNamespace(TP_PLAN={"*.weight": "S(0)"}, EP_PLAN={"experts.*": "S(0)"})
    for name, axes in PRESET_AXES.items():
        assert ManualPlan.parse(name, module).mesh_axes == axes, name


def _foreign_dir(out):
    """A folder of the user's that happens to hold ``checkpoints/`` and ``programs/`` (no adaptdist run.json)."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "programs").mkdir()
    (out / "checkpoints" / "my.txt").write_text("x")
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _all_paths(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


@pytest.mark.parametrize("run_json", [None, '{"my": "own file"}'])
def test_train_refuses_a_folder_that_was_never_an_adaptdist_run(capsys, tmp_path, run_json):
    """New-user report: ``train --out d`` printed 'holds a previous run (checkpoints, programs): replacing it' and
    deleted d/checkpoints/my.txt, though d held no run.json. Now: refused, typed, nothing created or removed."""
    out = tmp_path / "d"
    before = _foreign_dir(out)
    if run_json is not None:
        (out / "run.json").write_text(run_json)
        before = _files(out)
    paths = _all_paths(out)
    argv = ["train", f"{_model(tmp_path)}:f", "--nproc", "1", "--batch-size", "4", "--steps", "2", "--out", str(out),
            "--sample-bytes", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "NotARunDirError" in err and repr(str(out)) in err and "checkpoints, programs" in err, err
    assert "pass another --out" in err and "replacing it" not in err and "Traceback" not in err, err
    assert _files(out) == before and _all_paths(out) == paths, err  # no .lock either


def test_run_refuses_a_folder_that_was_never_an_adaptdist_run(capsys, tmp_path):
    out = tmp_path / "d"
    before = _foreign_dir(out)
    paths = _all_paths(out)
    art = tmp_path / "art"
    art.mkdir()
    assert main(["run", str(art), "--out", str(out), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "NotARunDirError" in err and repr(str(out)) in err and "pass another --out" in err, err
    assert _files(out) == before and _all_paths(out) == paths, err


def test_compile_refuses_a_folder_that_is_not_adaptdist_artifacts(capsys, tmp_path):
    out = tmp_path / "d"
    (out / "rank0").mkdir(parents=True)
    (out / "rank0" / "program.py").write_text("# mine")
    (out / "report.html").write_text("<p>mine</p>")
    before = _files(out)
    paths = _all_paths(out)
    assert main(["compile", f"{_model(tmp_path)}:f", "--nproc", "1", "--batch-size", "4", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "NotARunDirError" in err and repr(str(out)) in err and "report.html, rank0/" in err, err
    assert "pass another -o" in err, err
    assert _files(out) == before and _all_paths(out) == paths, err


def test_a_previous_run_is_replaced_and_nothing_else(tmp_path):
    """With adaptdist's run.json the folder is a previous run: its outputs go, the user's other files stay."""
    from adaptdist.cli.train import _clear_previous_run
    from adaptdist.console import report_console

    out = tmp_path / "out"
    out.mkdir()
    _previous_run(out)
    (out / "notes.txt").write_text("mine")
    _clear_previous_run(out, report_console(stderr=True))
    assert _all_paths(out) == ["notes.txt"]


def test_compile_into_its_previous_artifacts_is_allowed(tmp_path):
    from adaptdist.compiler.artifacts import check_replaceable_artifacts

    out = tmp_path / "art"
    (out / "rank0").mkdir(parents=True)
    (out / "manifest.json").write_text('{"format_version": 3, "adaptdist_version": "0.1"}')
    check_replaceable_artifacts(out)  # no error
    check_replaceable_artifacts(tmp_path / "new")  # a new directory: no error


def _saved_run(src, model, step):
    """A run directory as ``train`` leaves it: run.json and a complete checkpoint after ``step`` steps."""
    from adaptdist.runtime.checkpoint_store import commit, prepare

    src.mkdir()
    (src / "run.json").write_text(json.dumps({"version": 1, "state": "complete",
                                              "settings": {"model": model, "batch_size": 4, "steps": step}}))
    tmp = prepare(src / "checkpoints", step)
    (tmp / "state.bin").write_bytes(b"state")
    commit(tmp, {"step": step})


@pytest.mark.parametrize("where", ["new_out", "in_place"])
def test_a_refused_resume_creates_nothing(capsys, tmp_path, where):
    """New-user report: a --resume refused for its --steps still created the --out folder with a .lock in it."""
    src = tmp_path / "src"
    _saved_run(src, f"{_model(tmp_path)}:f", 4)
    before = _all_paths(src)
    out = tmp_path / "new" / "out" if where == "new_out" else src
    assert main(["train", "--resume", str(src), "--out", str(out), "--steps", "4", "--sample-bytes", "0"]) == 2
    err = capsys.readouterr().err
    assert "is at step 4 already" in err and "pass --steps greater than 4" in err, err
    assert not (tmp_path / "new").exists(), _all_paths(tmp_path)
    assert _all_paths(src) == before  # no .lock


def test_a_train_refused_after_the_lock_removes_what_it_created(capsys, tmp_path):
    """A refusal after --out was created and locked (here: a factory returning no batch) leaves no empty folder
    and no .lock behind; a folder that existed keeps its files and loses only the .lock this attempt made."""
    bad = _model(tmp_path, "import torch\ndef f(batch_size, seq_len):\n    return torch.nn.Linear(2, 2)\n")
    out = tmp_path / "a" / "b"
    assert main(["train", f"{bad}:f", "--nproc", "1", "--steps", "1", "--out", str(out), "--sample-bytes", "0"]) == 2
    assert "must return (model" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["train", f"{bad}:f", "--nproc", "1", "--steps", "1", "--out", str(kept), "--sample-bytes", "0"]) == 2
    assert _all_paths(kept) == ["notes.txt"]


def test_a_refused_run_resume_creates_nothing(capsys, tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    out = tmp_path / "never"
    assert main(["run", str(art), "--out", str(out), "--resume", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "no run.json there" in err, err
    assert not out.exists()
