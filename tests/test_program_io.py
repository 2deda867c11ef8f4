"""The on-disk program format: save/load round trip, integrity checks, nothing pickled."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from adaptdist import _torch_compat as compat
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import AdaptdistError, ProgramLoadError
from adaptdist.models.gpt import GPT, GPTConfig, lm_loss
from adaptdist.program import FORMAT_VERSION, MANIFEST, load_program, read_manifest, save_programs

WORLD = 2


@pytest.fixture(scope="module")
def compiled():
    """(programs, batch) for a tiny GPT on 2 data-parallel ranks; compiled once per module."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, num_layers=1, num_heads=2, max_seq_len=8))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 8), generator=g)
    targets = torch.randint(0, 256, (4, 8), generator=g)
    batch = (tokens, targets)
    return compile_model(model, batch, lm_loss, WORLD), batch


@pytest.fixture(scope="module")
def saved_dir(compiled, tmp_path_factory):
    """A pristine saved program directory; tests that damage it work on a copy (see ``progdir``)."""
    programs, _ = compiled
    return save_programs(programs, tmp_path_factory.mktemp("saved") / "programs")


@pytest.fixture
def progdir(saved_dir, tmp_path) -> Path:
    d = tmp_path / "programs"
    shutil.copytree(saved_dir, d)
    return d


def edit_manifest(d: Path, **changes) -> None:
    m = json.loads((d / MANIFEST).read_text())
    m.update(changes)
    (d / MANIFEST).write_text(json.dumps(m))


# --- round trip ------------------------------------------------------------------------------------

def test_compiled_programs_have_collectives(compiled):
    programs, _ = compiled
    assert sorted(programs) == list(range(WORLD))
    for r, p in programs.items():
        assert p.rank == r and p.world_size == WORLD and p.mesh == {"dp": WORLD}
        colls = p.collectives()
        assert colls, f"rank {r} issues no collectives"
        assert all("all_reduce" in c and "adaptdist:dp" in c for c in colls), colls
        assert "_c10d_functional.all_reduce" in p.code
    # Every rank issues the same collectives in the same order (else a real run hangs).
    assert len({tuple(p.collectives()) for p in programs.values()}) == 1
    # The batch is split on dim 0: rows [0, 2) and [2, 4).
    assert [p.batch_slice for p in programs.values()] == [(0, 2), (2, 2)]


def test_manifest(saved_dir, compiled):
    programs, _ = compiled
    m = read_manifest(saved_dir)
    assert m["format_version"] == FORMAT_VERSION
    assert m["torch_version"] == torch.__version__
    assert m["world_size"] == WORLD and m["mesh"] == {"dp": WORLD}
    for r in range(WORLD):
        for name in ("program.py", "program.json", "state.safetensors"):
            assert len(m["files"][f"rank{r}/{name}"]) == 64  # sha256 hex
    assert sorted(m["files"]) == sorted(
        str(p.relative_to(saved_dir)) for p in saved_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


@pytest.mark.parametrize("rank", range(WORLD))
def test_round_trip(saved_dir, compiled, rank):
    programs, _ = compiled
    orig = programs[rank]
    loaded = load_program(saved_dir, rank, world_size=WORLD)
    assert loaded.code == orig.code
    assert (saved_dir / f"rank{rank}" / "program.py").read_text() == orig.code
    for attr in ("rank", "world_size", "mesh", "group_names", "input_fqns", "param_fqns", "num_batch_inputs",
                 "batch_slice", "output_roles", "tied"):
        assert getattr(loaded, attr) == getattr(orig, attr), attr
    assert loaded.output_roles[0] == "loss" and loaded.loss_index == orig.loss_index
    assert sorted(loaded.state) == sorted(orig.state) == sorted(orig.input_fqns)
    for k, v in orig.state.items():
        assert loaded.state[k].dtype == v.dtype and torch.equal(loaded.state[k], v), k
    assert sorted(loaded.constants) == sorted(orig.constants)
    assert isinstance(loaded.module, torch.nn.Module) and not isinstance(loaded.module, torch.fx.GraphModule)
    assert str(loaded) == orig.code


def test_loaded_runs_like_compiled(saved_dir, compiled):
    """With a 1-process gloo group standing in for 'adaptdist:dp' (all_reduce = identity), the
    loaded source computes exactly what the compiled GraphModule computes."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    programs, batch = compiled
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name in programs[0].group_names.values():
            compat.register_process_group(name, dist.group.WORLD)
        for r, orig in programs.items():
            loaded = load_program(saved_dir, r, world_size=WORLD)
            args = (*[loaded.state[f] for f in loaded.input_fqns], *loaded.local_batch(batch))
            want, got = orig(*args), loaded(*args)
            assert len(got) == len(want) == len(orig.output_roles)
            for role, a, b in zip(orig.output_roles, want, got):
                assert torch.equal(a, b), f"rank {r} output {role}"
    finally:
        compat.unregister_all_process_groups()
        dist.destroy_process_group()


def test_nothing_pickled(saved_dir, monkeypatch):
    files = [p for p in saved_dir.rglob("*") if p.is_file()]
    assert files
    bad = [str(p) for p in files if p.suffix not in {".json", ".py", ".safetensors"}]
    assert not bad, f"unexpected files (pickles?): {bad}"
    for p in files:  # each file is what its suffix says
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".py":
            compile(p.read_text(), str(p), "exec")
        else:
            with safe_open(str(p), framework="pt") as f:
                assert list(f.keys()), p

    def refuse(*a, **k):
        raise AssertionError("load_program must not unpickle anything")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_program(saved_dir, 0, world_size=WORLD)


# --- errors ----------------------------------------------------------------------------------------

def load_error(d: Path, rank: int = 0, world_size: int | None = WORLD) -> str:
    with pytest.raises(ProgramLoadError) as ei:
        load_program(d, rank, world_size=world_size)
    assert isinstance(ei.value, AdaptdistError)
    return str(ei.value)


@pytest.mark.parametrize("name", ["program.py", "program.json", "state.safetensors"])
def test_missing_rank_file(progdir, name):
    (progdir / "rank1" / name).unlink()
    msg = load_error(progdir, rank=1)
    assert str(progdir / "rank1" / name) in msg and "missing" in msg
    load_program(progdir, 0, world_size=WORLD)  # the other rank's files are intact


def test_missing_rank_directory(progdir):
    shutil.rmtree(progdir / "rank1")
    msg = load_error(progdir, rank=1)
    assert "rank1" in msg and "missing" in msg


def test_modified_program_py(progdir):
    f = progdir / "rank0" / "program.py"
    f.write_text(f.read_text() + "\n# edited\n")
    msg = load_error(progdir)
    assert str(f) in msg and "sha256" in msg


def test_modified_state(progdir):
    f = progdir / "rank0" / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01  # flip one bit of the last tensor's data
    f.write_bytes(bytes(raw))
    msg = load_error(progdir)
    assert str(f) in msg and "sha256" in msg


def test_modified_program_json(progdir):
    f = progdir / "rank0" / "program.json"
    meta = json.loads(f.read_text())
    meta["batch_slice"] = [0, 4]
    f.write_text(json.dumps(meta))
    msg = load_error(progdir)
    assert str(f) in msg and "sha256" in msg


def test_other_torch_version(progdir):
    edit_manifest(progdir, torch_version="1.0.0")
    msg = load_error(progdir)
    assert str(progdir / MANIFEST) in msg and "1.0.0" in msg and torch.__version__ in msg


def test_other_format_version(progdir):
    edit_manifest(progdir, format_version=FORMAT_VERSION + 1)
    msg = load_error(progdir)
    assert str(progdir / MANIFEST) in msg and f"format version {FORMAT_VERSION + 1}" in msg


def test_world_size_mismatch(saved_dir):
    msg = load_error(saved_dir, rank=0, world_size=3)
    assert str(saved_dir) in msg and f"world size {WORLD}" in msg and "3 ranks" in msg


def test_rank_out_of_range(saved_dir):
    msg = load_error(saved_dir, rank=WORLD, world_size=None)
    assert f"rank {WORLD}" in msg and str(saved_dir) in msg


def test_missing_manifest(progdir):
    (progdir / MANIFEST).unlink()
    msg = load_error(progdir)
    assert str(progdir / MANIFEST) in msg and "does not exist" in msg


def test_not_a_program_directory(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert "manifest.json" in msg


def test_manifest_not_json(progdir):
    (progdir / MANIFEST).write_text("{not json")
    msg = load_error(progdir)
    assert str(progdir / MANIFEST) in msg and "not valid JSON" in msg


@pytest.mark.parametrize("field", ["format_version", "torch_version", "world_size", "files"])
def test_manifest_lacks_field(progdir, field):
    m = json.loads((progdir / MANIFEST).read_text())
    del m[field]
    (progdir / MANIFEST).write_text(json.dumps(m))
    msg = load_error(progdir)
    assert str(progdir / MANIFEST) in msg and repr(field) in msg


def test_manifest_lists_no_program_py(progdir):
    m = json.loads((progdir / MANIFEST).read_text())
    del m["files"]["rank0/program.py"]
    (progdir / MANIFEST).write_text(json.dumps(m))
    msg = load_error(progdir)
    assert "rank0/program.py" in msg


@pytest.mark.parametrize("name", ["state.safetensors", "program.json"])
def test_manifest_must_list_every_rank_file(progdir, name):
    m = json.loads((progdir / MANIFEST).read_text())
    del m["files"][f"rank0/{name}"]
    (progdir / MANIFEST).write_text(json.dumps(m))
    (progdir / "rank0" / name).unlink()
    assert f"rank0/{name}" in load_error(progdir)


def test_loaded_program_retraces_to_the_same_graph(saved_dir, compiled):
    programs, _ = compiled
    for rank, prog in programs.items():
        loaded = load_program(saved_dir, rank)
        assert loaded.graph_module is not prog.module  # a re-trace of the loaded source, on fake tensors
        assert loaded.collectives() == prog.collectives() != []
        # make_fx decomposes reshape (CompositeImplicit), so compare the compute ops that matter
        def matmuls(gm):
            return [n.target for n in gm.graph.nodes if "mm" in str(n.target)]
        assert matmuls(loaded.graph_module) == matmuls(prog.module) != []
