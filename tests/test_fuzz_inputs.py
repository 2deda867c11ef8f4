"""Fuzzing as tests (issue 18): generated cluster files, plan files (YAML and plan.json), program-directory
manifests and CLI argument sets either load and validate or raise adaptdist's own error naming the file,
within a time and memory bound (tests/fuzz_inputs.py). A short deterministic run here (fixed
``max_examples``, ``derandomize=True``); the long one is ``benchmarks/bench_fuzz.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

import fuzz_inputs as fz  # noqa: E402

CI = dict(derandomize=True, deadline=None, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much])


def _check(outcome: str, what: str) -> None:
    assert not outcome.startswith("FAIL"), f"{what}\n{outcome}"


@settings(max_examples=250, **CI)
@given(text=fz.cluster_texts())
def test_cluster_files(tmp_path, text):
    _check(fz.run_case(fz.cluster_case(text, tmp_path), [str(tmp_path / "cluster.yaml")]), text[:2000])


@settings(max_examples=120, **CI)
@given(text=fz.plan_yaml_texts())
def test_manual_plan_files(tmp_path, text):
    _check(fz.run_case(fz.plan_yaml_case(text, tmp_path), [str(tmp_path / "plan.yaml"), "'plan.yaml'"]), text[:2000])


@settings(max_examples=150, **CI)
@given(text=fz.plan_json_texts())
def test_plan_json_files(tmp_path, text):
    _check(fz.run_case(fz.plan_json_case(text, tmp_path), [str(tmp_path / "plan.json")]), text[:2000])


@settings(max_examples=200, **CI)
@given(argv=fz.cli_argvs())
def test_cli_argument_sets(tmp_path, argv):
    _check(fz.run_case(fz.cli_case(argv, tmp_path), ["--"]), repr(argv))


@pytest.fixture(scope="module")
def program_dirs(tmp_path_factory):
    """Two saved compiles of tests/models.py's MLP on 2 ranks: data parallel (the one edited) and FSDP-like
    (where a swapped-in rank comes from)."""
    from models import mlp

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import save_programs

    root = tmp_path_factory.mktemp("fuzz_programs")
    out = []
    for name in ("dp", "fsdp"):
        model, batch, loss = mlp(batch_size=8)
        programs = compile_model(model, batch, loss, 2, ManualPlan.parse(name))
        from safetensors.torch import save as save_tensors

        out.append(save_programs(programs, root / name, extra_files={
            "example_batch.safetensors": save_tensors({f"b{i}": x.contiguous() for i, x in enumerate(batch)})}))
    return out


def _pristine_docs(d):
    import json

    return json.loads((d / "manifest.json").read_text()), json.loads((d / "rank0" / "program.json").read_text())


def test_pristine_program_dirs_load(program_dirs):
    assert fz.run_case(fz.artifact_case(("manifest", _pristine_docs(program_dirs[0])[0], 0), *program_dirs,
                                        program_dirs[0].parent / "pristine"), []) == "accepted"


def test_artifact_edits(program_dirs, tmp_path):
    from hypothesis import given as given_

    manifest, meta = _pristine_docs(program_dirs[0])
    seen = {}

    @settings(max_examples=100, **CI)
    @given_(edit=fz.artifact_edits(manifest, meta))
    def run(edit):
        outcome = fz.run_case(fz.artifact_case(edit, *program_dirs, tmp_path), [str(tmp_path / "programs")])
        _check(outcome, repr(edit)[:2000])
        seen.setdefault(edit[0], set()).add(outcome)

    run()
    # a rank from another compile is never accepted; nor is a batch slice that no longer partitions the batch
    assert seen.get("swap_rank") == {"clean"}, seen
    assert "clean" in seen.get("batch_slice", set()), seen


torch  # imported first: hypothesis' own import is slow enough without torch's on the first example
