"""``--resume`` from another working directory: the run's relative paths (model file, --data, a plan file), recorded
as typed, still name the run's files (``run.json`` records the directory the run started in)."""

from __future__ import annotations

import json

from adaptdist.cli.main import build_parser
from adaptdist.cli.train import RUN_FILE, _restored_args, write_run_file


def _resumed(run_dir, elsewhere, monkeypatch):
    ap = build_parser()
    defaults = vars(ap.parse_args(["train"]))
    args = ap.parse_args(["train", "--resume", str(run_dir)])
    monkeypatch.chdir(elsewhere)
    _restored_args(args, defaults)
    return args


def test_relative_model_data_and_plan_resolve_against_the_runs_directory(tmp_path, monkeypatch):
    start = tmp_path / "project"
    start.mkdir()
    for name in ("m.py", "corpus.txt", "plan.yaml"):
        (start / name).write_text("")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(start)
    write_run_file(run_dir, {"model": "m.py:factory", "data": "corpus.txt", "plan": "plan.yaml", "steps": 5},
                   "interrupted")
    assert json.loads((run_dir / RUN_FILE).read_text())["cwd"] == str(start)
    other = tmp_path / "elsewhere"
    other.mkdir()
    args = _resumed(run_dir, other, monkeypatch)
    assert args.model == f"{start / 'm.py'}:factory"
    assert args.data == str(start / "corpus.txt") and args.plan == str(start / "plan.yaml")


def test_paths_that_name_files_here_presets_and_builtins_are_kept(tmp_path, monkeypatch):
    start = tmp_path / "project"
    start.mkdir()
    (start / "m.py").write_text("")
    run_dir = tmp_path / "r2"
    run_dir.mkdir()
    monkeypatch.chdir(start)
    write_run_file(run_dir, {"model": "m.py:factory", "plan": "dp", "steps": 5}, "interrupted")
    args = _resumed(run_dir, start, monkeypatch)  # the same directory: as typed
    assert args.model == "m.py:factory" and args.plan == "dp"
    write_run_file(run_dir, {"model": "builtin:gpt", "plan": "fsdp", "steps": 5}, "interrupted")
    other = tmp_path / "o"
    other.mkdir()
    args = _resumed(run_dir, other, monkeypatch)
    assert args.model == "builtin:gpt" and args.plan == "fsdp"
