"""Hostile and careless input, generated with hypothesis: cluster files, plan files (YAML manual plans and
``plan.json``), program-directory manifests and CLI argument sets. Shared by ``tests/test_fuzz_inputs.py`` (a
short deterministic run in CI) and ``benchmarks/bench_fuzz.py`` (a long one).

Every case must end in one of two ways: it loads and validates (``accepted``), or it raises adaptdist's own
error type (:class:`adaptdist.errors.AdaptdistError`) whose message names the file (``clean``). Anything
else is a failure: another exception, more than :data:`TIME_LIMIT_S` seconds (a SIGALRM timer), or more than
:data:`MEMORY_LIMIT_BYTES` of Python allocations at peak (tracemalloc).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import shutil
import signal
import tracemalloc
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from hypothesis import strategies as st

from adaptdist.errors import AdaptdistError

TIME_LIMIT_S = 10.0
"""Longest one case may take (a load under heavy machine load included)."""
MEMORY_LIMIT_BYTES = 256 * 2**20
"""Most Python memory one case may allocate at peak."""


class CaseTimeout(Exception):
    """Raised inside a case by the SIGALRM timer."""


@dataclass
class Tally:
    """Outcomes of a run: cases, clean errors, accepted, failures (with what failed)."""

    cases: int = 0
    clean: int = 0
    accepted: int = 0
    failures: list[str] = field(default_factory=list)
    peak_bytes: int = 0
    slowest_s: float = 0.0

    def row(self, name: str) -> str:
        return (f"| {name} | {self.cases} | {self.clean} | {self.accepted} | {len(self.failures)} | "
                f"{self.slowest_s:.2f} | {self.peak_bytes / 2**20:.1f} |")


def run_case(fn: Callable[[], Any], names: list[str], tally: Tally | None = None) -> str:
    """Run ``fn`` bounded in time and memory; returns ``accepted`` or ``clean``, or a failure text starting with
    ``FAIL`` (``names``: strings one of which a clean error's message must contain -- the file)."""
    import time

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()

    def alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            fn()
        outcome = "accepted"
    except CaseTimeout:
        outcome = f"FAIL: no answer within {TIME_LIMIT_S} s"
    except AdaptdistError as e:
        msg = str(e)
        outcome = "clean" if any(n in msg for n in names) else f"FAIL: {type(e).__name__} names no file: {msg[:300]}"
    except SystemExit as e:  # argparse's refusal (exit 2, message on stderr)
        outcome = "clean" if e.code == 2 else f"FAIL: SystemExit({e.code!r})"
    except Exception as e:  # noqa: BLE001 - the point: any other exception is a failure
        outcome = f"FAIL: {type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-1500:]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wall = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    if started:
        tracemalloc.stop()
    if peak > MEMORY_LIMIT_BYTES and not outcome.startswith("FAIL"):
        outcome = f"FAIL: {peak / 2**20:.0f} MiB at peak (limit {MEMORY_LIMIT_BYTES / 2**20:.0f} MiB)"
    if tally is not None:
        tally.cases += 1
        tally.peak_bytes = max(tally.peak_bytes, peak)
        tally.slowest_s = max(tally.slowest_s, wall)
        if outcome == "accepted":
            tally.accepted += 1
        elif outcome == "clean":
            tally.clean += 1
        else:
            tally.failures.append(outcome)
    return outcome


# --- values a careless user or an attacker writes ----------------------------------------------------

DEEP = "__DEEP_{}__"
"""A placeholder replaced in the file's text by a list nested that many levels deep."""

_SPECIAL = [None, True, False, 0, -1, -0.0, 1, 2, 7, 2**31, 2**63, 2**70, 10**30, 1e308, -1e308, 5e-324, 1e-300,
            0.5, 1.5e9, 8e9, "", " ", "cpu", "cuda", "CPU", "tpu", "1e9", "nan", "inf", ".nan", "null", "\n", "a\nb",
            "x" * 300, "S(0)", "S(9)", "R", "P(sum)", "P(max)", "S(-1)", "S(²)", "Shard(1)", "dp", "tp", "pp",
            "fc1.weight", "*", "intra_host", "inter_host", "all_reduce", "gloo", "nccl", "2025-01-01T00:00:00",
            [], {}, ["cpu"], [0, 1], [1, 0], [0, 0], {"float32": 1e11}, {"x": 1}, [[0]], [None]]


def nasty_values() -> st.SearchStrategy:
    """Scalars and small structures of every type, at the edges of every range, and deep nesting."""
    return st.one_of(
        st.sampled_from(_SPECIAL),
        st.integers(min_value=-2**80, max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=4),
        st.dictionaries(st.text(max_size=6), st.integers(-2, 2), max_size=3),
        st.integers(min_value=40, max_value=4000).map(DEEP.format),
    ).map(copy.deepcopy)  # the sampled lists and dicts are shared: an edit must not reach the next case


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def mutated(draw, base: Any, max_mutations: int = 3) -> Any:
    """``base`` with 1..``max_mutations`` edits: a value replaced by a nasty one, a key deleted, an unknown key
    added, a list entry duplicated or removed."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add_key", "duplicate"]))
        if not path:
            if action == "replace":
                doc = draw(nasty_values())
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if action == "replace":
            parent[key] = draw(nasty_values())
        elif action == "delete":
            del parent[key]
        elif action == "add_key" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "rank", "kind", "name", "tier", "ranks", "1", "mesh"]))] = \
                draw(nasty_values())
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(draw(st.integers(0, len(parent))), copy.deepcopy(parent[key]))
    return doc


def _scrub(doc: Any) -> Any:
    """``doc`` with every value JSON/YAML can write (non-string keys become strings for JSON)."""
    if isinstance(doc, dict):
        return {(k if isinstance(k, str) else str(k)): _scrub(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_scrub(v) for v in doc]
    return doc


def render(doc: Any, fmt: str) -> str:
    """``doc`` as ``yaml`` or ``json`` text, every :data:`DEEP` placeholder replaced by a nested list."""
    if fmt == "json":
        text = json.dumps(_scrub(doc), allow_nan=True)
    else:
        text = yaml.safe_dump(doc, default_flow_style=None, width=100, allow_unicode=True)
    for n in sorted({int(m) for m in _deep_counts(text)}, reverse=True):
        text = text.replace(f"'{DEEP.format(n)}'", "[" * n + "]" * n).replace(f'"{DEEP.format(n)}"', "[" * n + "]" * n)
        text = text.replace(DEEP.format(n), "[" * n + "]" * n)
    return text


def _deep_counts(text: str) -> list[str]:
    import re

    return re.findall(r"__DEEP_(\d+)__", text)


# --- the documents --------------------------------------------------------------------------------

def base_cluster() -> dict:
    """A valid schema-2 cluster file: two hosts of two cpu ranks, both link tiers, a calibration block."""
    def dev(r):
        return {"rank": r, "kind": "cpu", "cores": 1.0, "peak_flops": {"float32": 1.0e11, "bfloat16": 2.0e11},
                "memory_bytes": 8589934592, "memory_bandwidth_bytes_per_s": 1.0e10, "op_overhead_s": 3.5e-6}
    return {
        "schema_version": 2,
        "hosts": [{"name": "a", "devices": [dev(0), dev(1)]}, {"name": "b", "devices": [dev(2), dev(3)]}],
        "links": [{"tier": "intra_host", "bandwidth_bytes_per_s": 1.5e9, "latency_s": 2.0e-4},
                  {"tier": "inter_host", "bandwidth_bytes_per_s": 1.0e9, "latency_s": 5.0e-4},
                  {"ranks": [0, 1], "bandwidth_bytes_per_s": 2.0e9, "latency_s": 1.5e-4}],
        "calibration": {"measured_at": "2025-01-01T12:00:00+00:00", "backend": "gloo", "torch_version": "2.13.0",
                        "wall_s": 41.2, "collectives": {"intra_host": {
                            "all_reduce": {"alpha_s": 1.9e-4, "beta_s_per_byte": 6.8e-10, "num_ranks": 2,
                                           "rms_rel_error": 0.08}}}},
    }


def base_cluster_v1() -> dict:
    return {"schema_version": 1, "hosts": [{"name": "a", "device_kind": "cpu", "num_devices": 2},
                                           {"name": "b", "device_kind": "cpu", "num_devices": 2}]}


def cluster_texts() -> st.SearchStrategy:
    """Cluster file texts: mutated version 2 and version 1 documents as YAML or JSON, and raw text."""
    docs = st.one_of(mutated(base_cluster()), mutated(base_cluster()), mutated(base_cluster_v1()))
    return st.one_of(
        st.tuples(docs, st.sampled_from(["yaml", "json"])).map(lambda t: render(*t)),
        st.text(max_size=200),
        st.sampled_from(["", "---", "[", "{", "a: *b", "a: &x [*x]", "!!python/object:os.system {}",
                         "schema_version: 2\nhosts: &h [*h]\n", "\x00\x01", "schema_version: 2\n" + "  " * 50 + "x"]),
    )


SHAPES = {"fc1.weight": (24, 12), "fc1.bias": (24,), "fc2.weight": (5, 24), "fc2.bias": (5,)}
"""The parameters plan files are resolved against (tests/models.py's MLP)."""


def base_manual_plan() -> dict:
    return {"schema_version": 2, "mesh": ["dp", "tp"], "batch_axis": "dp",
            "params": {"fc1.weight": ["R", "S(0)"], "fc1.bias": ["R", "S(0)"], "fc2.weight": ["R", "S(1)"]}}


def base_manual_plan_v1() -> dict:
    return {"schema_version": 1, "mesh_axis": "tp", "shard_batch": False, "params": {"fc1.*": "S(0)"}}


def base_plan_json() -> dict:
    """A valid plan.json document (schema 2, with a lowering record) for :data:`SHAPES` on a 2x2 mesh."""
    from adaptdist.placement import Replicate, Shard
    from adaptdist.plan import Departure, LoweringRecord, Plan, Redistribution
    from adaptdist.strategy import Strategy

    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    plan = Plan(mesh={"dp": 2, "tp": 2}, batch_axis="dp",
                param_placements={"fc1.weight": (r, s0), "fc2.weight": (r, s1)}, graph_fingerprint="ab" * 32,
                node_placements={"mm": (s0, r), "mm_1": (s0, (None, r))}, name="fuzz",
                node_strategies={"mm": (Strategy((s0, r), (s0,), "adaptdist"), None)},
                lowered=LoweringRecord({"fc1.weight": (r, s0)}, {"mm": (s0, r)},
                                       {"tp": (Redistribution("mm_1", "tanh", s0, r, "all_gather_into_tensor"),)},
                                       (Departure("mm", "tp", "the rule disagreed"),)))
    return json.loads(plan.to_json())


def plan_yaml_texts() -> st.SearchStrategy:
    docs = st.one_of(mutated(base_manual_plan()), mutated(base_manual_plan_v1()))
    return st.one_of(st.tuples(docs, st.sampled_from(["yaml", "json"])).map(lambda t: render(*t)),
                     st.text(max_size=100))


def plan_json_texts() -> st.SearchStrategy:
    return st.one_of(mutated(base_plan_json(), 4).map(lambda d: render(d, "json")), st.text(max_size=100))


# --- the cases --------------------------------------------------------------------------------------

def cluster_case(text: str, directory: Path) -> Callable[[], Any]:
    from adaptdist.calibrate.local import load_cluster

    path = directory / "cluster.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")

    def case():
        c = load_cluster(path)
        assert c.world_size >= 1
        for d in c.devices:  # accepted figures are finite and within the stated ranges
            assert all(math.isfinite(v) for v in d.peak_flops.values())
        return c
    return case


def plan_yaml_case(text: str, directory: Path) -> Callable[[], Any]:
    from adaptdist.annotations import ManualPlan

    path = directory / "plan.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")

    def case():
        plan = ManualPlan.parse(str(path))
        m = plan.mesh(4, None)
        return plan.axis_placements(SHAPES, set(SHAPES), {a: m.size(a) for a in m.names})
    return case


def plan_json_case(text: str, directory: Path) -> Callable[[], Any]:
    from adaptdist.plan import Plan
    from adaptdist.plan_checks import check_plan_params

    path = directory / "plan.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")

    def case():
        plan = Plan.load(path)
        check_plan_params(plan, SHAPES)
        plan.differences()
        Plan.from_json(plan.to_json(), str(path))  # what loads also writes and loads back
        return plan
    return case


MANIFEST_EDITS = ("manifest", "program_json", "swap_rank", "batch_slice")


@st.composite
def artifact_edits(draw, manifest: dict, meta: dict) -> tuple[str, Any, int]:
    """``(kind, new document, rank)``: a mutated manifest, a mutated rank's program.json (hashes then fixed),
    a rank directory from another compile (hashes fixed), or an edited batch slice (hashes fixed)."""
    kind = draw(st.sampled_from(MANIFEST_EDITS))
    rank = draw(st.integers(0, 1))
    if kind == "manifest":
        return kind, draw(mutated(manifest, 2)), rank
    if kind == "program_json":
        return kind, draw(mutated(meta, 2)), rank
    if kind == "batch_slice":
        return kind, [draw(st.integers(-2, 9)), draw(st.integers(-2, 9))], rank
    return kind, None, rank


def artifact_case(edit: tuple[str, Any, int], pristine: Path, other: Path, directory: Path) -> Callable[[], Any]:
    """Copy ``pristine`` (a saved 2-rank program directory) into ``directory``, apply ``edit`` (``other``: a
    directory of another compile), then check and load it."""
    from adaptdist.program import _sha256, check_artifacts, load_program

    d = directory / "programs"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(pristine, d)
    kind, doc, rank = edit
    mpath = d / "manifest.json"
    if kind == "manifest":
        mpath.write_text(render(doc, "json"))
    else:
        rel = f"rank{rank}/program.json"
        if kind == "swap_rank":
            shutil.rmtree(d / f"rank{rank}")
            shutil.copytree(other / f"rank{rank}", d / f"rank{rank}")
        elif kind == "batch_slice":
            meta = json.loads((d / rel).read_text())
            meta["batch_slice"] = doc
            (d / rel).write_text(json.dumps(meta))
        else:
            (d / rel).write_text(render(doc, "json"))
        m = json.loads(mpath.read_text())  # the careful forger fixes the hashes
        for f in list(m["files"]):
            if f.startswith(f"rank{rank}/") and (d / f).is_file():
                m["files"][f] = _sha256(d / f)
        mpath.write_text(json.dumps(m))

    def case():
        check_artifacts(d, None)
        return [load_program(d, r) for r in range(2)]
    return case


# CLI: every numeric flag of every command, with values at and beyond its edges
CLI_COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "train": (["train"], ["--nproc", "--batch-size", "--seq-len", "--bucket-mb", "--steps", "--lr", "--max-grad-norm",
                          "--seed", "--threads-per-rank", "--checkpoint-every", "--keep", "--max-restarts",
                          "--timeout-s", "--collective-timeout-s", "--sample-bytes", "--mesh", "--nnodes"]),
    "plan": (["plan"], ["--nproc", "--batch-size", "--seq-len", "--bucket-mb", "--mesh"]),
    "estimate": (["estimate"], ["--nproc", "--batch-size", "--seq-len", "--bucket-mb", "--mesh"]),
    "compile": (["compile", "-o", "OUT"], ["--nproc", "--batch-size", "--seq-len", "--bucket-mb"]),
    "run": (["run", "DIR"], ["--steps", "--lr", "--seed", "--checkpoint-every", "--keep", "--max-restarts",
                             "--timeout-s"]),
    "profile": (["cluster", "profile"], ["--nproc", "--max-message-mib", "--timeout-s"]),
    "detect": (["cluster", "detect"], ["--nproc"]),
    "launch": (["launch"], ["--nproc", "--timeout-s", "--max-restarts"]),
    "zoo": (["zoo"], ["--ranks", "--steps", "--lr", "--timeout-s"]),
}
NUMBER_TEXTS = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e308", "1e309", "-1", "0", "-0", "0.0", "1",
                "2", "3:2", "2:4", "1:1000", "0x10", "1_000", "²", "١", " 3", "3 ", "", "1e3", str(2**63),
                str(2**63 - 1), str(2**70), "9" * 50, "9" * 5000, "100000000", "1000", "dp=2", "dp=0", "dp=²",
                "dp=100000000", "dp=2,tp=2", "dp=" + "9" * 30, "=", ",", "dp=2,dp=2"]


@st.composite
def cli_argvs(draw) -> list[str]:
    """An argument list: a command, then 1..4 of its numeric flags with edge values."""
    name = draw(st.sampled_from(sorted(CLI_COMMANDS)))
    head, flags = CLI_COMMANDS[name]
    argv = list(head)
    for _ in range(draw(st.integers(1, 4))):
        flag = draw(st.sampled_from(flags))
        value = draw(st.one_of(st.sampled_from(NUMBER_TEXTS), st.integers(-2**70, 2**70).map(str),
                               st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=6)))
        argv.append(f"{flag}={value}")
    if name == "launch":
        argv.append("script.py")
    return argv


@functools.lru_cache(maxsize=1)
def _parser():
    """``adaptdist``'s parser, built once (argparse parsers are reusable; building one takes ~0.1 s)."""
    from adaptdist.cli.main import build_parser

    return build_parser()


def cli_case(argv: list[str], directory: Path) -> Callable[[], Any]:
    """Parse ``argv`` as ``adaptdist`` does and apply the checks made before any work (the batch-size limit, the
    mesh, the local cluster); accepted numbers must be finite and in range."""
    argv = [str(directory / a) if a in ("OUT", "DIR") else a for a in argv]

    def case():
        from adaptdist import limits
        from adaptdist.arg_types import MAX_SEED
        args = _parser().parse_args(argv)
        for k, v in vars(args).items():
            if isinstance(v, float):
                assert math.isfinite(v) and v > 0, (k, v)
            if isinstance(v, int) and not isinstance(v, bool) and k != "seed":
                assert 0 <= v <= 2**40, (k, v)
        assert 0 <= getattr(args, "seed", 0) <= MAX_SEED
        limits.check_batch_items(getattr(args, "batch_size", None), getattr(args, "seq_len", None))
        if getattr(args, "mesh", None):
            from adaptdist.calibrate.local import local_cluster
            from adaptdist.mesh import Mesh

            local_cluster(Mesh.parse(args.mesh).world_size)
        return args
    return case
