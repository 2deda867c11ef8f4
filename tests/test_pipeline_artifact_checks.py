"""Pipeline program directories (adaptdist.stage_program_io) are checked like rank programs: nothing pickled, the
compile id recomputed from the files, every rank's program.json typed and the ranks agreeing; an edited or swapped
rank file is refused naming the file, even when the forger rehashed the manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions
from adaptdist.errors import ProgramLoadError
from adaptdist.models import gpt
from adaptdist.program import _sha256, check_artifacts
from adaptdist.stage_program_io import load_pipeline_program, save_pipeline_programs


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """Two compiles of a 2-stage tiny GPT that differ only in their schedule."""
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(max_seq_len=8, dim=16, num_layers=2, num_heads=2)
    m, batch, loss_fn = gpt.factory(4, 8, cfg)
    progs = compile_model(m, batch, loss_fn, 2, None, mesh="pp=2", pipeline=PipelineOptions(microbatches=2,
                                                                                                 schedule="1f1b"))
    root = tmp_path_factory.mktemp("pp")
    other = {r: dataclasses.replace(p, schedule="gpipe") for r, p in progs.items()}
    return {"1f1b": save_pipeline_programs(progs, root / "a"), "gpipe": save_pipeline_programs(other, root / "b")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fix_hashes(d: Path) -> None:
    """What a careful forger does after editing: every digest in the manifest recomputed."""
    m = json.loads((d / "manifest.json").read_text())
    m["files"] = {f: _sha256(d / f) for f in m["files"] if (d / f).is_file()}
    (d / "manifest.json").write_text(json.dumps(m))


def _refused(d: Path, *words: str) -> str:
    with pytest.raises(ProgramLoadError) as ei:
        check_artifacts(d, None)
    msg = str(ei.value)
    assert all(w in msg for w in words), msg
    return msg


def test_pristine_pipeline_directory_passes_and_holds_no_pickle(compiles):
    d = compiles["1f1b"]
    m = check_artifacts(d, None)
    assert m["kind"] == "pipeline" and len(m["compile_id"]) == 64 and "rank1/program.py" in m["compile_covers"]
    assert not list(d.rglob("*.pt")) and not list(d.rglob("*.pkl"))
    meta = json.loads((d / "rank1" / "program.json").read_text())
    assert meta["compile_id"] == m["compile_id"] and meta["files"]["program.py"] == m["files"]["rank1/program.py"]
    assert load_pipeline_program(d, 1, world_size=2).stages[0].stage == 1
    assert (json.loads((compiles["gpipe"] / "manifest.json").read_text())["compile_id"] != m["compile_id"])


def test_an_edited_rank_program_is_refused_naming_it_even_with_fixed_hashes(compiles, tmp_path):
    d = _copy(compiles["1f1b"], tmp_path / "a")
    p = d / "rank1" / "program.py"
    p.write_text(p.read_text() + "\n# edited\n")
    _fix_hashes(d)
    _refused(d, str(p), "edited or replaced")
    with pytest.raises(ProgramLoadError, match="rank1/program.py.*edited or replaced"):
        load_pipeline_program(d, 1)  # each rank on its own (torchrun) refuses too


def test_a_rank_directory_from_another_compile_is_refused_naming_it(compiles, tmp_path):
    d = _copy(compiles["1f1b"], tmp_path / "mixed")
    shutil.rmtree(d / "rank1")
    shutil.copytree(compiles["gpipe"] / "rank1", d / "rank1")
    _fix_hashes(d)
    _refused(d, str(d / "rank1" / "program.json"), "another compile")
    with pytest.raises(ProgramLoadError, match="rank1/program.json.*another compile"):
        load_pipeline_program(d, 1)


def test_swapped_rank_files_are_refused_naming_the_file(compiles, tmp_path):
    d = _copy(compiles["1f1b"], tmp_path / "swapped")
    a, b = d / "rank0" / "program.json", d / "rank1" / "program.json"
    ta, tb = a.read_text(), b.read_text()
    a.write_text(tb)
    b.write_text(ta)
    _fix_hashes(d)
    _refused(d, str(a), "'rank'", "rank 0's")
    d = _copy(compiles["1f1b"], tmp_path / "swapped_state")  # the two ranks' state files exchanged
    sa, sb = d / "rank0" / "state.safetensors", d / "rank1" / "state.safetensors"
    ba, bb = sa.read_bytes(), sb.read_bytes()
    sa.write_bytes(bb)
    sb.write_bytes(ba)
    _fix_hashes(d)
    _refused(d, str(sa), "edited or replaced")


def test_ranks_that_disagree_are_refused_naming_both_files(compiles, tmp_path):
    d = _copy(compiles["1f1b"], tmp_path / "specs")
    p = d / "rank1" / "program.json"
    meta = json.loads(p.read_text())
    meta["stages"][0]["recv_specs"][0][0][0] += 1  # rank 1 would wait for a tensor rank 0 never sends
    p.write_text(json.dumps(meta))
    _fix_hashes(d)
    _refused(d, str(d / "rank0" / "program.json"), str(p), "send_specs", "recv_specs")
    d = _copy(compiles["1f1b"], tmp_path / "typed")
    p = d / "rank0" / "program.json"
    meta = json.loads(p.read_text())
    meta["stages"][0]["classes"]["forward"] = "__builtins__"  # the loader looks classes up by these names
    p.write_text(json.dumps(meta))
    _fix_hashes(d)
    _refused(d, str(p), "'classes'", "Stage0Forward")
    meta["stages"][0]["classes"]["forward"] = "Stage0Forward"
    meta["batch_slice"] = [0, 3]
    p.write_text(json.dumps(meta))
    _fix_hashes(d)
    _refused(d, str(p), "'batch_slice'", "num_microbatches x microbatch_rows")


def test_a_shared_memory_group_one_member_lacks_is_refused(compiles, tmp_path):
    """Rank 1 would set up a shared-memory group with rank 0, which rank 0 never joins (a hang at start)."""
    d = _copy(compiles["1f1b"], tmp_path / "shm")
    p = d / "rank1" / "program.json"
    meta = json.loads(p.read_text())
    meta["shm_groups"] = {"adaptdist:grads[0,1]": [0, 1]}
    p.write_text(json.dumps(meta))
    _fix_hashes(d)
    _refused(d, str(d / "rank0" / "program.json"), str(p), "shm_groups['adaptdist:grads[0,1]']")


def test_stages_of_different_sizes_each_partition_the_batch(tmp_path):
    """`--stage-ranks 2,1`, 2 microbatches of 6 rows: stage 0's two ranks read rows 0..2 and 6..8, and 3..5 and
    9..11 (microbatch_stride 6), stage 1's one rank all 12; each stage's ranks cover the batch once, so the directory
    loads (it was refused as an overlap); a stage whose ranks do not cover it, or cover other rows than another
    stage's, is still refused naming the stage."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    progs = compile_model(m, (x, y), torch.nn.functional.mse_loss, 3, None,
                          pipeline=PipelineOptions(microbatches=2, schedule="1f1b", stage_ranks=(2, 1)))
    d = save_pipeline_programs(progs, tmp_path / "pp21")
    metas = {r: json.loads((d / f"rank{r}" / "program.json").read_text()) for r in range(3)}
    assert {r: (m["batch_slice"], m["microbatch_stride"]) for r, m in metas.items()} == {
        0: ([0, 6], 6), 1: ([3, 6], 6), 2: ([0, 12], 6)}
    check_artifacts(d, None)

    def edited(name: str, **fields) -> Path:
        bad = _copy(d, tmp_path / name)
        p = bad / "rank1" / "program.json"
        p.write_text(json.dumps({**metas[1], **fields}))
        _fix_hashes(bad)
        return bad

    # rank 1 reads rank 0's rows: stage 0 leaves rows 3..5 to no rank
    _refused(edited("same", batch_slice=[0, 6]), "rank(s) [0, 1] of stage 0", "leaves rows 3..5 to no rank")
    _refused(edited("overlap", batch_slice=[2, 6]), "rank(s) [1] of stage 0", "[2, 5)", "overlaps")
    # rank 1 reads its rows contiguously from row 6: stage 0 covers rows 0..2 and 6..11 (a gap)
    _refused(edited("stride", batch_slice=[6, 6], microbatch_stride=0), "of stage 0", "leaves rows 3..5")
    _refused(edited("short", microbatch_stride=2), "'microbatch_stride'", "fewer than microbatch_rows 3")
    # stage 0's ranks cover rows 0..7 only (2 rows of each 4-row microbatch each), stage 1's rank rows 0..11
    short = _copy(d, tmp_path / "fewer")
    for r in (0, 1):
        (short / f"rank{r}" / "program.json").write_text(json.dumps(
            {**metas[r], "batch_slice": [2 * r, 4], "microbatch_rows": 2, "microbatch_stride": 4}))
    _fix_hashes(short)
    _refused(short, "of stage 1 read batch rows 0..11", "of stage 0 read rows 0..7")
