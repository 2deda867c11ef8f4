"""Each hostile or careless input that the issue-18 probe found, as a test: a typed error naming the file and the
field (never a traceback), stated limits checked before any work, and artifacts checked for meaning (one
compile, the batch partitioned) before anything runs. The generated cases are tests/test_fuzz_inputs.py."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest

from adaptdist.calibrate.local import load_cluster, local_cluster
from adaptdist.cli.main import main
from adaptdist.errors import ClusterSpecError, ProgramLoadError, UsageError

DEV = ("{rank: %d, kind: cpu, peak_flops: {float32: 1.0e+11}, memory_bytes: 8589934592, "
       "memory_bandwidth_bytes_per_s: 1.0e+10}")
GOOD = ("schema_version: 2\nhosts:\n  - name: localhost\n    devices:\n      - " + DEV % 0 + "\n      - " + DEV % 1
        + "\nlinks:\n  - {tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}\n")


def _write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(ClusterSpecError) as ei:
        load_cluster(path)
    msg = str(ei.value)
    assert str(path) in msg and all(w in msg for w in words), msg
    return msg


def test_the_good_file_loads(tmp_path):
    assert load_cluster(_write(tmp_path, GOOD)).world_size == 2


# --- cluster files: tracebacks before, field-level errors now ----------------------------------------

def test_a_list_where_the_kind_belongs(tmp_path):
    _refused(_write(tmp_path, GOOD.replace("kind: cpu", "kind: [cpu]", 1)), "hosts[0].devices[0].kind", "['cpu']")


@pytest.mark.parametrize("text", [
    "schema_version: 2\nhosts: " + "[" * 5000 + "]" * 5000 + "\n",           # flow style: libyaml's own limit
    "schema_version: 2\nhosts: " + "[" * 60 + "]" * 60 + "\n",               # deeper than adaptdist's 32
    "schema_version: 2\nhosts:\n" + "".join("  " * i + "- \n" for i in range(1, 200)),  # block style
    "schema_version: 2\nhosts: &h [*h]\n",                                   # a list that contains itself
])
def test_very_deep_or_self_referring_nesting(tmp_path, text):
    path = _write(tmp_path, text)
    t0 = time.perf_counter()
    msg = _refused(path)
    assert time.perf_counter() - t0 < 60 and ("nest" in msg or "refers to itself" in msg or "YAML" in msg), msg


def test_aliases_that_expand_exponentially_are_refused(tmp_path):
    lines = ["schema_version: 2", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]  # 10**9 values
    lines += ["hosts: *a8"]
    tracemalloc.start()
    try:
        _refused(_write(tmp_path, "\n".join(lines) + "\n"), "values")
        assert tracemalloc.get_traced_memory()[1] < 64 * 2**20
    finally:
        tracemalloc.stop()


def test_every_figure_at_1e308_is_refused_field_by_field(tmp_path):
    text = GOOD
    for v in ("1.0e+11", "1.0e+10", "1.5e+9", "2.0e-4", "8589934592"):
        text = text.replace(v, "1e308")
    _refused(_write(tmp_path, text), "field 'hosts[0].devices[0].peak_flops.float32'", "1e+308", "outside the range")


def test_every_figure_at_1e308_no_longer_reaches_a_compiler_pass(tmp_path, capsys):
    text = GOOD
    for v in ("1.0e+11", "1.0e+10", "1.5e+9", "8589934592"):
        text = text.replace(v, "1e308")
    path = _write(tmp_path, text)
    assert main(["estimate", "--cluster", str(path), "--batch-size", "2", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert "ClusterSpecError" in err and "InternalError" not in err and str(path) in err, err


NONSENSE = [  # each loaded silently before: (edit of GOOD, the field named)
    (("rank: 0,", "rank: 0, rank: 1,"), "twice"),                                      # YAML keeps the last
    (("kind: cpu,", "kind: cuda, cores: 4.0,"), "devices[0].cores"),                   # cores is a cpu rank's share
    (("memory_bytes: 8589934592", "memory_bytes: 1"), "devices[0].memory_bytes"),        # a 1-byte rank
    (("peak_flops: {float32: 1.0e+11}", "peak_flops: {float32: 1373}"), "peak_flops.float32"),
    (("latency_s: 2.0e-4", "latency_s: 6"), "links[0].latency_s"),                      # six seconds a message
    (("memory_bandwidth_bytes_per_s: 1.0e+10}", "memory_bandwidth_bytes_per_s: 1.0e+10, op_overhead_s: 3}"),
     "op_overhead_s"),                                                                  # three seconds an op
    (("name: localhost", "name: \"local\\nhost\""), "hosts[0].name"),                    # forges log lines
    (("links:", "calibration: {collectives: {}}\nlinks:"), "calibration.collectives"),   # calibrated by nothing
    (("links:", "calibration: {backend: mpi, collectives: {intra_host: {all_reduce: {alpha_s: 1.0e-4, "
                "beta_s_per_byte: 1.0e-9}}}}\nlinks:"), "calibration.backend"),
    (("links:", "calibration: {measured_at: yesterday, collectives: {intra_host: {all_reduce: {alpha_s: 1.0e-4, "
                "beta_s_per_byte: 1.0e-9}}}}\nlinks:"), "calibration.measured_at"),
]


@pytest.mark.parametrize("edit,field", NONSENSE, ids=[f for _, f in NONSENSE])
def test_nonsense_that_was_accepted_is_refused(tmp_path, edit, field):
    old, new = edit
    assert old in GOOD
    _refused(_write(tmp_path, GOOD.replace(old, new, 1)), field)


# --- stated limits, checked before any work ----------------------------------------------------------

def test_a_hundred_million_devices_are_refused_before_allocating(tmp_path):
    path = _write(tmp_path, "schema_version: 1\nhosts:\n  - {name: h, device_kind: cpu, num_devices: 100000000}\n")
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _refused(path, "hosts[0].num_devices", "100000000", "ADAPTDIST_MAX_RANKS")
        assert time.perf_counter() - t0 < 60 and tracemalloc.get_traced_memory()[1] < 16 * 2**20
    finally:
        tracemalloc.stop()


def test_the_rank_limit_is_stated_and_overridable(tmp_path, monkeypatch):
    from adaptdist import limits

    path = _write(tmp_path, "schema_version: 1\nhosts:\n  - {name: h, device_kind: cpu, num_devices: 5000}\n")
    assert limits.max_ranks() == limits.MAX_RANKS == 4096
    _refused(path, "5000 ranks", "limit of 4096")
    monkeypatch.setenv("ADAPTDIST_MAX_RANKS", "5000")
    assert load_cluster(path).world_size == 5000
    monkeypatch.setenv("ADAPTDIST_MAX_RANKS", "lots")
    with pytest.raises(UsageError, match="ADAPTDIST_MAX_RANKS"):
        load_cluster(path)


@pytest.mark.parametrize("cmd", [["plan"], ["estimate"], ["compile", "-o", "OUT"], ["train"], ["cluster", "detect"],
                                 ["cluster", "profile"], ["launch", "x.py"]])
def test_nproc_1000_is_refused_at_parse_time(capsys, tmp_path, cmd):
    argv = [str(tmp_path / a) if a == "OUT" else a for a in cmd]
    argv = argv[:-1] + ["--nproc", "1000", argv[-1]] if cmd[0] == "launch" else argv + ["--nproc", "1000"]
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--nproc" in err and "limit of 256" in err and "ADAPTDIST_MAX_LOCAL_RANKS" in err, err
    assert time.perf_counter() - t0 < 60 and not (tmp_path / "OUT").exists()


def test_the_local_rank_limit_is_overridable(monkeypatch):
    from adaptdist.cli.main import build_parser

    monkeypatch.setenv("ADAPTDIST_MAX_LOCAL_RANKS", "1000")
    assert build_parser().parse_args(["plan", "--nproc", "1000"]).nproc == 1000
    monkeypatch.delenv("ADAPTDIST_MAX_LOCAL_RANKS")
    with pytest.raises(ClusterSpecError, match="limit of 256"):
        local_cluster(1000)  # --mesh dp=1000, or a saved plan's mesh, go through it too


def test_ten_thousand_device_files_are_refused_unless_allowed(tmp_path):
    text = "schema_version: 1\nhosts:\n" + "".join(f"  - {{name: h{i}, device_kind: cpu, num_devices: 8}}\n"
                                                   for i in range(1250))
    # counted host by host: refused at the host that passes the limit, before any device is built
    _refused(_write(tmp_path, text), "hosts[512].num_devices", "over the limit of 4096", "ADAPTDIST_MAX_RANKS")


def test_long_planning_prints_its_progress_when_not_on_a_terminal(monkeypatch):
    from adaptdist.compiler.planner import summary

    class Console:
        is_terminal = False
        lines: list = []

        def print(self, text):
            self.lines.append(text)

    monkeypatch.setattr(summary, "PROGRESS_EVERY_S", 0.0)
    c = Console()
    progress = summary._LineProgress(c)
    progress("mesh dp=8,tp=125 (13 of 140 shapes, 11 s)")
    assert c.lines == ["planning: mesh dp=8,tp=125 (13 of 140 shapes, 11 s)"]
    c.is_terminal = True  # a terminal shows rich's status line instead
    progress("again")
    assert len(c.lines) == 1


def test_batch_items_are_limited_before_the_batch_is_built(capsys):
    t0 = time.perf_counter()
    assert main(["plan", "--batch-size", "100000", "--seq-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert "UsageError" in err and "--batch-size 100000 x --seq-len 100000" in err and time.perf_counter() - t0 < 60


# --- argument values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["train", "--sample-bytes", "-5"], "--sample-bytes"),
    (["train", "--threads-per-rank", "100000"], "--threads-per-rank"),
    (["train", "--batch-size", str(2**25)], "--batch-size"),
    (["launch", "--timeout-s", "nan", "x.py"], "--collective-timeout-s"),
    (["cluster", "profile", "--max-message-mib", "1e9"], "--max-message-mib"),
    (["train", "--seed", "9" * 5000], "--seed"),
    (["zoo", "--ranks", "999"], "--ranks"),
    (["train", "--steps", str(2**70)], "--steps"),                  # a count past int64: only a rank would fail
    (["train", "--checkpoint-every", "63523124357880"], "--checkpoint-every"),
    (["train", "--max-restarts", str(10**12)], "--max-restarts"),
])
def test_absurd_values_are_refused_by_the_parser(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("module,argv", [
    ("adaptdist.runtime.run_artifacts", ["DIR", "--lr", "nan"]),
    ("adaptdist.runtime.run_artifacts", ["DIR", "--seed", str(2**70)]),
    ("adaptdist.runtime.run_artifacts", ["DIR", "--timeout-s", "inf"]),
])
def test_the_runtime_entry_points_share_the_argument_types(capsys, module, argv):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2 and "argument --" in capsys.readouterr().err


def test_script_runner_refuses_a_nan_timeout():
    from adaptdist.runtime.script_runner import _parser

    with pytest.raises(SystemExit):
        _parser().parse_args(["--timeout-s", "nan", "x.py"])


def test_mesh_sizes_in_other_scripts_are_refused():
    from adaptdist.mesh import Mesh

    for text in ("dp=²", "dp=١", "dp=" + "9" * 5000, "dp=2,dp=2"):
        with pytest.raises(UsageError, match="--mesh"):
            Mesh.parse(text)


@pytest.mark.parametrize("argv", [["plan", "--out", "/proc/adaptdist-x.json"], ["cluster", "detect", "--out",
                                                                                  "/proc/adaptdist-c.yaml"],
                                  ["zoo", "--out", "/proc/adaptdist-zoo"]])
def test_unwritable_out_is_found_before_any_work(capsys, argv):
    t0 = time.perf_counter()
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert "UsageError" in cap.err and "--out" in cap.err and "planning" not in cap.out, cap.err
    assert time.perf_counter() - t0 < 60


def test_out_directory_is_probed_by_writing(tmp_path, monkeypatch):
    """Permission bits say nothing to root: the check writes a file (here, a failing write stands for a read-only
    mount)."""
    import tempfile

    from adaptdist.cli.common import prepare_out_dir

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(UsageError, match="Read-only file system"):
        prepare_out_dir(str(tmp_path / "out"))


# --- plan files --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_fsdp(tmp_path_factory):
    """(model, batch, loss, plan.json path) of tests/models.py's MLP under the fsdp preset on 2 ranks."""
    from models import mlp

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model

    model, batch, loss = mlp(batch_size=8)
    programs = compile_model(model, batch, loss, 2, ManualPlan.parse("fsdp"))
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    path.write_text(programs[0].plan.to_json())
    return model, batch, loss, path


def _edited_plan(src: Path, dst: Path, edit) -> Path:
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return dst


def test_shard_9_of_a_2d_weight_in_plan_json_is_named_like_the_yaml_path(mlp_fsdp, tmp_path):
    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.plan import Plan

    model, batch, loss, src = mlp_fsdp
    path = _edited_plan(src, tmp_path / "edited.json", lambda d: d["param_placements"].update({"fc1.weight": ["S(9)"]}))
    with pytest.raises(UsageError) as ei:
        compile_model(model, batch, loss, 2, Plan.load(path))
    msg = str(ei.value)
    assert str(path) in msg and "param_placements['fc1.weight']" in msg and "shards dim 9 of 'fc1.weight'" in msg
    assert "[24, 12]" in msg
    yaml_plan = tmp_path / "p.yaml"
    yaml_plan.write_text("schema_version: 2\nmesh: [dp]\nbatch_axis: dp\nparams:\n  fc1.weight: [S(9)]\n")
    with pytest.raises(UsageError, match=r"shards dim 9 of 'fc1.weight', which has shape \[24, 12\]"):
        compile_model(model, batch, loss, 2, ManualPlan.parse(str(yaml_plan)))


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(batch_axis=[]), "batch_axis"),
    (lambda d: d.update(mesh=[["dp", 2], ["dp", 2]]), "mesh"),
    (lambda d: d.update(mesh=[["dp", True]]), "mesh"),
    (lambda d: d.update(param_placements={"fc1.weight": "S(0)"}), "param_placements"),
    (lambda d: d.update(node_strategies=[]), "node_strategies"),
    (lambda d: d.update(lowered={"param_placements": []}), "lowered.param_placements"),
    (lambda d: d.update(schema_version="2"), "schema_version"),
    (lambda d: d.update(mesh=[["dp", 2**40]]), "mesh"),
])
def test_plan_json_fields_are_type_checked_on_load(mlp_fsdp, tmp_path, edit, field):
    from adaptdist.plan import Plan

    path = _edited_plan(mlp_fsdp[3], tmp_path / "edited.json", edit)
    with pytest.raises(UsageError) as ei:
        Plan.load(path)
    assert str(path) in str(ei.value) and f"'{field}'" in str(ei.value), str(ei.value)


def test_plan_json_nested_too_deeply(tmp_path):
    from adaptdist.plan import Plan

    path = tmp_path / "deep.json"
    path.write_text('{"schema_version": 2, "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(UsageError, match="deep"):
        Plan.load(path)


def test_plan_yaml_errors_of_the_plan_itself_name_the_file(tmp_path):
    from adaptdist.annotations import ManualPlan

    p = tmp_path / "p.yaml"
    p.write_text("schema_version: 2\nmesh: ['d p']\n")  # found by bench_fuzz.py: the message lacked the file
    with pytest.raises(UsageError, match=f"plan file '{p}'.*identifier"):
        ManualPlan.parse(str(p))
    p.write_text("schema_version: 2\nmesh: [dp]\nparams:\n  fc1.bias: [Q]\n")  # found by bench_fuzz.py too
    with pytest.raises(UsageError, match="plan 'p.yaml': field params, mesh axis 'dp': annotation 'fc1.bias'"):
        ManualPlan.parse(str(p)).axis_placements({"fc1.bias": (24,)})
    p.write_text("schema_version: 1\nmesh_axis: '1x'\n")
    with pytest.raises(UsageError, match=f"plan file '{p}'"):
        ManualPlan.parse(str(p))


def test_plan_yaml_duplicate_keys_and_depth(tmp_path):
    from adaptdist.annotations import ManualPlan

    p = tmp_path / "p.yaml"
    p.write_text("schema_version: 2\nmesh: [dp]\nparams:\n  fc1.weight: [S(0)]\n  fc1.weight: [R]\n")
    with pytest.raises(UsageError, match="twice"):
        ManualPlan.parse(str(p))
    p.write_text("schema_version: 2\nmesh: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(UsageError, match=str(p)):
        ManualPlan.parse(str(p))


# --- artifacts: typed errors for hand edits, meaning checked before anything runs --------------------

@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """Two saved compiles of the MLP on 2 ranks, data parallel and FSDP-like, each with its example batch."""
    from models import mlp
    from safetensors.torch import save as save_tensors

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import save_programs

    root = tmp_path_factory.mktemp("compiles")
    out = {}
    for name in ("dp", "fsdp"):
        model, batch, loss = mlp(batch_size=8)
        programs = compile_model(model, batch, loss, 2, ManualPlan.parse(name))
        out[name] = save_programs(programs, root / name, extra_files={
            "example_batch.safetensors": save_tensors({f"b{i}": x.contiguous() for i, x in enumerate(batch)})})
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fix_hashes(d: Path) -> None:
    """What a careful forger does after editing: every digest in the manifest recomputed."""
    from adaptdist.program import _sha256

    m = json.loads((d / "manifest.json").read_text())
    m["files"] = {f: _sha256(d / f) for f in m["files"] if (d / f).is_file()}
    (d / "manifest.json").write_text(json.dumps(m))


def _check_refused(d: Path, *words: str) -> str:
    from adaptdist.program import check_artifacts

    with pytest.raises(ProgramLoadError) as ei:
        check_artifacts(d, None)
    msg = str(ei.value)
    assert all(w in msg for w in words), msg
    return msg


def test_pristine_compiles_pass(compiles):
    from adaptdist.program import check_artifacts, load_program

    for d in compiles.values():
        m = check_artifacts(d, None)
        assert len(m["compile_id"]) == 64 and "rank0/program.py" in m["compile_covers"]
        assert load_program(d, 1).batch_slice in ((4, 4), (4, 4))
    assert (json.loads((compiles["dp"] / "manifest.json").read_text())["compile_id"]
            != json.loads((compiles["fsdp"] / "manifest.json").read_text())["compile_id"])


@pytest.mark.parametrize("edit,words", [
    (lambda m: m.update(files=[]), ("'files'", "must map")),                   # a list where the map belongs
    (lambda m: m.update(world_size="2"), ("'world_size'", "integer")),         # a string where a number belongs
    (lambda m: m["files"].update({"../../etc/passwd": "0" * 64}), ("'files'", "relative paths")),
    (lambda m: m.update(mesh={"dp": 3}), ("'mesh'", "world size")),
    (lambda m: m["files"].update({"rank0/program.py": "not a digest"}), ("files['rank0/program.py']", "sha256")),
    (lambda m: m.update(rng="sometimes"), ("'rng'",)),
])
def test_hand_edited_manifests_give_typed_errors(compiles, tmp_path, edit, words):
    from adaptdist.program import load_program

    d = _copy(compiles["dp"], tmp_path / "a")
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    msg = _check_refused(d, str(d / "manifest.json"), *words)
    assert "Traceback" not in msg
    with pytest.raises(ProgramLoadError):
        load_program(d, 0)


def test_a_manifest_that_is_not_an_object(compiles, tmp_path):
    d = _copy(compiles["dp"], tmp_path / "a")
    (d / "manifest.json").write_text("[1, 2]")
    _check_refused(d, "JSON object")


def test_a_rank_directory_from_another_compile_is_refused_even_with_fixed_hashes(compiles, tmp_path, capsys):
    d = _copy(compiles["dp"], tmp_path / "mixed")
    shutil.rmtree(d / "rank1")
    shutil.copytree(compiles["fsdp"] / "rank1", d / "rank1")
    _fix_hashes(d)
    _check_refused(d, "another compile", "rank1")
    from adaptdist.program import load_program

    with pytest.raises(ProgramLoadError, match="another compile"):
        load_program(d, 1)  # each rank on its own (torchrun) refuses too
    t0 = time.perf_counter()
    assert main(["run", str(d), "--steps", "1", "--out", str(tmp_path / "o")]) == 2  # before any rank starts
    assert "another compile" in capsys.readouterr().err and time.perf_counter() - t0 < 120


@pytest.mark.parametrize("rows", [[0, 4], [2, 4], [4, 6], [4, 2]])
def test_an_edited_batch_slice_is_refused(compiles, tmp_path, rows):
    d = _copy(compiles["dp"], tmp_path / "a")
    meta = json.loads((d / "rank1" / "program.json").read_text())
    meta["batch_slice"] = rows
    (d / "rank1" / "program.json").write_text(json.dumps(meta))
    _fix_hashes(d)
    _check_refused(d)


def test_the_batch_partition_rule_itself(tmp_path):
    """Without a compile id (a forger who recomputes it), the slices must still partition the batch."""
    from adaptdist.artifact_checks import check_batch_partition

    def metas(*slices):
        return {r: {"batch_slice": list(s), "batch_specs": [[[s[1], 3], "float32"]]} for r, s in enumerate(slices)}

    m = {"files": {}}
    check_batch_partition(metas((0, 4), (4, 4)), tmp_path, m)
    check_batch_partition(metas((0, 4), (0, 4), (4, 4), (4, 4)), tmp_path, m)  # dp x tp: groups share a slice
    check_batch_partition(metas((0, 3), (3, 2)), tmp_path, m)  # uneven
    for bad, why in [(((0, 4), (2, 4)), "overlaps"), (((0, 4), (6, 2)), "leaves rows 4..5"),
                     (((1, 4), (5, 3)), "leaves rows 0..0")]:
        with pytest.raises(ProgramLoadError, match=why):
            check_batch_partition(metas(*bad), tmp_path, m)
    bad = metas((0, 4), (4, 4))
    bad[1]["batch_specs"] = [[[2, 3], "float32"]]
    with pytest.raises(ProgramLoadError, match="batch_specs"):
        check_batch_partition(bad, tmp_path, m)


def test_an_unlisted_example_batch_is_refused(compiles, tmp_path):
    d = _copy(compiles["dp"], tmp_path / "a")
    m = json.loads((d / "manifest.json").read_text())
    del m["files"]["example_batch.safetensors"]
    m["compile_covers"].remove("example_batch.safetensors")
    (d / "manifest.json").write_text(json.dumps(m))
    _check_refused(d)
