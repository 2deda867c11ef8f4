"""Checks of a program directory's meaning, beyond its hashes (:mod:`adaptdist.program` checks those):

- the manifest is type-checked field by field (a hand edit gives a :class:`ProgramLoadError` naming the field,
  not a ``KeyError`` or ``TypeError``), and its file list names only relative paths inside the directory;
- every rank's ``program.json`` is type-checked the same way and says the rank, world size and mesh the
  manifest says;
- every rank's program is from one compile: each ``program.json`` carries the ``compile_id`` of the manifest
  (a digest of all ranks' code, metadata and state, :func:`compile_id`), so a directory mixed from two
  compiles is refused even when its manifest's hashes were edited to match (it would otherwise hang at its
  first collective until the timeout);
- pipeline programs (manifest ``kind: pipeline``, :mod:`adaptdist.pipeline_artifact_checks`): every rank's
  ``program.json`` typed the same way, and the ranks agree with each other: one schedule and stage layout, each
  stage's sends matching its peer's receives, each gradient group's members holding the parameter;
- the ranks' ``batch_slice`` rows partition the global batch: distinct slices do not overlap and cover rows
  0..B-1 (B from ``example_batch.safetensors`` when present; pipeline programs: each stage's ranks partition it,
  every stage the same rows), and each rank's slice has the rows its program's batch inputs have (an edited slice would otherwise train on the wrong rows, silently).

All before any program is executed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from . import limits, safe_load
from .errors import ProgramLoadError

_HEX64 = re.compile(r"[0-9a-f]{64}")
RNG_MODES = ("per-rank", "global")
PIPELINE_KIND = "pipeline"
"""The manifest's ``kind`` of a directory of pipeline programs (:mod:`adaptdist.stage_program_io`)."""


COMPILE_ID_EXCLUDES = ("files", "compile_id", "compile_covers", "model_file")
"""Manifest fields outside the compile id: the files it covers enter through their digests; ``model_file`` is a
location, which may be edited when the directory and the model move (its content is ``model_file_sha256``)."""


def compile_id(file_digests: Mapping[str, str], metas: Mapping[int, Mapping[str, Any]],
               manifest: Mapping[str, Any] | None = None) -> str:
    """The id of one compile: sha256 over the digests of the files it covers (every rank's code, state and
    constants, the plan, the example batch), every rank's program metadata (without its ``compile_id``) and the
    manifest's fields (but :data:`COMPILE_ID_EXCLUDES`); equal only for programs that are interchangeable."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(file_digests.items())).encode())
    fields = {k: v for k, v in (manifest or {}).items() if k not in COMPILE_ID_EXCLUDES}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for r in sorted(metas):
        h.update(json.dumps({k: v for k, v in metas[r].items() if k != "compile_id"}, sort_keys=True,
                            default=str).encode())
    return h.hexdigest()


class _Fields:
    """Type checks of one JSON object whose failures name the file and the field."""

    def __init__(self, doc: object, source: str) -> None:
        self.source = source
        if not isinstance(doc, dict):
            raise self.fail("", f"must be a JSON object, got {type(doc).__name__}")
        self.doc = doc

    def fail(self, name: str, why: str) -> ProgramLoadError:
        where = f"field {name!r} " if name else ""
        return ProgramLoadError(f"{self.source}: {where}{why}; compile again (a hand-edited or damaged file)")

    def has(self, name: str) -> bool:
        return name in self.doc

    def need(self, name: str) -> Any:
        if name not in self.doc:
            raise self.fail(name, "is missing")
        return self.doc[name]

    def int(self, name: str, least: int = 0, greatest: float = math.inf, v: Any = None, path: str = "") -> int:
        v = self.need(name) if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or not least <= v <= greatest:
            hi = "" if greatest == math.inf else f"..{int(greatest)}"
            raise self.fail(path or name, f"must be an integer {least}{hi}, got {_short(v)}")
        return v

    def str(self, name: str, pattern: re.Pattern | None = None, v: Any = None, path: str = "") -> str:
        v = self.need(name) if v is None else v
        if not isinstance(v, str) or (pattern is not None and not pattern.fullmatch(v)):
            want = "a sha256 (64 lowercase hex digits)" if pattern is _HEX64 else "a string"
            raise self.fail(path or name, f"must be {want}, got {_short(v)}")
        return v

    def str_list(self, name: str) -> list[str]:
        v = self.need(name)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail(name, f"must be a list of strings, got {_short(v)}")
        return v

    def str_map(self, name: str, value_ok, want: str) -> dict:
        v = self.need(name)
        if not isinstance(v, dict) or not all(isinstance(k, str) and value_ok(x) for k, x in v.items()):
            raise self.fail(name, f"must map names to {want}, got {_short(v)}")
        return v

    def mesh(self, name: str, world_size: int, pipeline: bool = False) -> dict[str, int]:
        """``pipeline``: stage groups may run on sub-meshes of different sizes, the mesh then holding the largest
        (``plan.Plan.world_size``): its size is at least the world size, and its ``pp`` axis at most."""
        m = self.str_map(name, lambda n: isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                         "axis sizes >= 1")
        if pipeline and m.get("pp", 1) <= world_size <= math.prod(m.values()):
            return m
        if math.prod(m.values()) != world_size:
            raise self.fail(name, f"is {m}, whose sizes multiply to {math.prod(m.values())}, not the world size "
                                  f"{world_size}")
        return m


def _short(v: Any) -> str:
    import reprlib

    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict = 60, 60, 6, 6
    return f"{type(v).__name__} {r.repr(v)}"


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def check_manifest(manifest: object, mpath: Path) -> dict:
    """Type-check a parsed ``manifest.json`` (``mpath`` names it); returns it.

    Raises:
        ProgramLoadError: names the file and the field that is missing or malformed.
    """
    f = _Fields(manifest, repr(str(mpath)))
    f.int("format_version", 0)
    f.str("torch_version")
    if f.has("adaptdist_version"):
        f.str("adaptdist_version")
    world = f.int("world_size", 1, limits.max_ranks())
    files = f.need("files")
    if not isinstance(files, dict):
        raise f.fail("files", f"must map relative paths to sha256 digests, got {_short(files)}")
    for rel, digest in files.items():
        p = PurePosixPath(rel) if isinstance(rel, str) else None
        if p is None or not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or "\x00" in rel:
            raise f.fail("files", f"names {_short(rel)}; the manifest lists only relative paths inside its directory")
        f.str(rel, _HEX64, v=digest, path=f"files[{rel!r}]")
    if f.has("mesh"):
        f.mesh("mesh", world, pipeline=manifest.get("pipeline") is True or manifest.get("kind") == "pipeline")
    if f.has("compile_id"):
        f.str("compile_id", _HEX64)
    for key in ("cluster_fingerprint", "model", "model_file", "optimizer"):
        if f.has(key):
            f.str(key)
    if f.has("model_file_sha256"):
        f.str("model_file_sha256", _HEX64)
    for key in ("batch_size", "seq_len"):
        if f.has(key):
            f.int(key, 1, limits.MAX_BATCH_DIM)
    if f.has("num_batch_inputs"):
        f.int("num_batch_inputs", 0, 4096)
    if f.has("kind") and f.need("kind") != PIPELINE_KIND:
        raise f.fail("kind", f"must be {PIPELINE_KIND!r} (pipeline programs) or absent, got {_short(f.need('kind'))}")
    if f.has("rng") and f.need("rng") not in RNG_MODES:
        raise f.fail("rng", f"must be one of {list(RNG_MODES)}, got {_short(f.need('rng'))}")
    if f.has("kernels"):
        kernels = f.need("kernels")
        if not isinstance(kernels, list) or not all(k in ("shm",) for k in kernels):
            raise f.fail("kernels", f"must list the C++ kernels the programs use (['shm']), got {_short(kernels)}")
    if f.has("transports"):
        transports = f.need("transports")
        if not isinstance(transports, dict) or not all(isinstance(a, str) and t in ("shm", "gloo", "none")
                                                       for a, t in transports.items()):
            raise f.fail("transports", f"must map mesh axes to 'shm', 'gloo' or 'none', got {_short(transports)}")
    if f.has("cluster_hosts"):
        hosts = f.need("cluster_hosts")
        if not isinstance(hosts, list) or not all(
                isinstance(h, list) and len(h) == 3 and isinstance(h[0], str) and isinstance(h[2], str)
                and isinstance(h[1], int) and not isinstance(h[1], bool) and h[1] >= 1 for h in hosts):
            raise f.fail("cluster_hosts", f"must be [[host, devices, kind], ...], got {_short(hosts)}")
    return manifest  # type: ignore[return-value]


def check_program_meta(meta: object, path: Path, rank: int, manifest: Mapping[str, Any]) -> dict:
    """Type-check rank ``rank``'s parsed ``program.json`` (``path``) and match it to the manifest; returns it.

    Raises:
        ProgramLoadError: a field missing or malformed, or another rank, world size, mesh or compile than the
            manifest's; names the file and the field.
    """
    f = _Fields(meta, repr(str(path)))
    world = manifest["world_size"]
    if f.int("rank", 0) != rank:
        raise f.fail("rank", f"is {meta['rank']}, but the file is rank {rank}'s")  # type: ignore[index]
    if f.int("world_size", 1) != world:
        raise f.fail("world_size", f"is {meta['world_size']}, the manifest's is {world}")  # type: ignore[index]
    mesh = f.mesh("mesh", world)
    if "mesh" in manifest and mesh != manifest["mesh"]:
        raise f.fail("mesh", f"is {mesh}, the manifest's is {manifest['mesh']}")
    f.str_map("group_names", lambda v: isinstance(v, str), "process-group names")
    inputs = f.str_list("input_fqns")
    params = f.str_list("param_fqns")
    if not set(params) <= set(inputs):
        raise f.fail("param_fqns", f"names {sorted(set(params) - set(inputs))[:5]}, which are not in input_fqns")
    nb = f.int("num_batch_inputs", 0, 4096)
    sl = f.need("batch_slice")
    if not (_is_int_list(sl) and len(sl) == 2):
        raise f.fail("batch_slice", f"must be [first row, rows] (integers >= 0), got {_short(sl)}")
    roles = f.str_list("output_roles")
    if "loss" not in roles:
        raise f.fail("output_roles", "has no 'loss'")
    specs = f.need("batch_specs")
    if not (isinstance(specs, list) and len(specs) == nb and all(
            isinstance(s, list) and len(s) == 2 and _is_int_list(s[0]) and isinstance(s[1], str) for s in specs)):
        raise f.fail("batch_specs", f"must be {nb} [[local shape], dtype] pair(s) (num_batch_inputs), got "
                                    f"{_short(specs)}")
    for key in ("tied",):
        if f.has(key):
            f.str_map(key, lambda v: isinstance(v, str), "names")
    if f.has("constants"):
        f.str_list("constants")
    if f.has("state_placements"):
        f.str_map("state_placements", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                  "lists of placement texts")
    if f.has("global_shapes"):
        f.str_map("global_shapes", _is_int_list, "shapes (lists of integers >= 0)")
    check_compile_id(meta, path, manifest)
    return meta  # type: ignore[return-value]


def check_compile_id(meta: Mapping[str, Any], path: Path, manifest: Mapping[str, Any]) -> None:
    """Rank metadata ``meta`` (from ``path``) carries the manifest's ``compile_id``.

    Raises:
        ProgramLoadError: another compile's; names the file and both ids.
    """
    want = manifest.get("compile_id")
    got = meta.get("compile_id")
    if want is not None or got is not None:
        if got != want:
            raise ProgramLoadError(
                f"{str(path)!r} is from another compile than {str(path.parent.parent / 'manifest.json')!r} (compile id "
                f"{str(got)[:12]}..., the manifest's {str(want)[:12]}...): the directory mixes the ranks of two "
                "compiles, which would hang at the first collective; copy one compile's whole directory, or "
                "compile again")


def _global_rows(directory: Path, manifest: Mapping[str, Any]) -> int | None:
    """Rows of the global batch: dim 0 of ``example_batch.safetensors``'s first tensor (its header only)."""
    p = directory / "example_batch.safetensors"
    if "example_batch.safetensors" not in manifest["files"] or not p.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(p), "pt") as fh:
            keys = sorted(fh.keys())
            if "b0" not in keys:
                return None
            shape = fh.get_slice("b0").get_shape()
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, not importable by name
        raise ProgramLoadError(f"{str(p)!r} is not a readable safetensors file: {e}; compile again") from None
    return int(shape[0]) if shape else None


def _rows_read(m: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` row ranges a rank's program reads: its ``batch_slice``; a pipeline rank whose
    ``microbatch_stride`` differs from its ``microbatch_rows`` (stages of different sizes) reads
    ``[off + m*stride, off + m*stride + rows)`` of each microbatch ``m`` (:class:`~adaptdist.stage_program.
    PipelineRankProgram`)."""
    off, size = m["batch_slice"]
    rows, stride = m.get("microbatch_rows", size), m.get("microbatch_stride") or 0
    if not stride or stride == rows:
        return ((off, off + size),)
    return tuple((off + i * stride, off + i * stride + rows) for i in range(m["num_microbatches"]))


def _partition_end(metas: Mapping[int, Mapping[str, Any]], where: str, whose: str) -> int:
    """The rows the ranks' distinct row sets (:func:`_rows_read`) cover, from 0 without gap or overlap; returns the
    end."""
    sets = {r: _rows_read(m) for r, m in metas.items()}
    ranges = sorted({rg for rs in sets.values() for rg in rs})
    end = 0
    for start, stop in ranges:
        if start != end:
            who = sorted(r for r, rs in sets.items() if (start, stop) in rs)
            what = "overlaps the rows of another rank" if start < end else f"leaves rows {end}..{start - 1} to no rank"
            raise ProgramLoadError(
                f"{where}: rank(s) {who}{whose} read batch rows [{start}, {stop}), which {what}: the ranks' "
                "batch_slice values must partition the batch; compile again")
        end = stop
    return end


def _stage_groups(metas: Mapping[int, Mapping[str, Any]], manifest: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """The groups whose ranks together read the batch once: all ranks, or, for pipeline programs, each stage's
    ranks (every stage runs the whole batch, split among its data-parallel ranks; stages may differ in size)."""
    if manifest.get("kind") != PIPELINE_KIND or not metas:
        return [("", dict(metas))]
    stage_ranks = next(iter(metas.values()))["stage_ranks"]  # (check_pipeline_ranks: every rank's is the same)
    return [(f" of stage {s}", {r: metas[r] for r in stage_ranks[s] if r in metas})
            for s in sorted(stage_ranks, key=int)]


def check_batch_partition(metas: Mapping[int, Mapping[str, Any]], directory: Path,
                          manifest: Mapping[str, Any]) -> None:
    """The ranks' ``batch_slice`` rows partition the global batch (module docstring); for pipeline programs each
    stage's ranks partition it.

    Raises:
        ProgramLoadError: names the rank, its slice (and stage) and what is wrong.
    """
    where = f"the programs in {str(directory)!r}"
    for r, m in sorted(metas.items()):
        off, size = m["batch_slice"]
        for i, (shape, _) in enumerate(m.get("batch_specs", ())):  # (pipeline programs: checked per microbatch)
            if shape and shape[0] != size:
                raise ProgramLoadError(
                    f"{where}: rank {r}'s batch_slice [{off}, {size}] gives {size} rows, but its program takes "
                    f"batch input {i} with {shape[0]} rows (batch_specs); the slice was edited: compile again")
    rows = _global_rows(directory, manifest)
    first = None
    for whose, group in _stage_groups(metas, manifest):
        end = _partition_end(group, where, whose)
        if rows is not None and end != rows:
            raise ProgramLoadError(f"{where}: the batch slices of the ranks{whose} cover rows 0..{end - 1}, but the "
                                   f"global batch (example_batch.safetensors) has {rows} rows; compile again")
        if first is not None and end != first[1]:
            raise ProgramLoadError(f"{where}: the ranks{whose} read batch rows 0..{end - 1}, but the ranks"
                                   f"{first[0]} read rows 0..{first[1] - 1}; every stage runs the whole batch: "
                                   "compile again")
        first = first or (whose, end)


def check_compile(directory: str | Path, manifest: Mapping[str, Any], check_meta: Any = None,
                  check_ranks: Any = None) -> dict[int, dict]:
    """Read and check every rank's ``program.json`` against ``manifest`` (one compile, the same world and mesh,
    the batch partitioned); returns rank -> metadata. ``check_meta(meta, path, rank, manifest)`` checks one
    rank's metadata (default :func:`check_program_meta`; pipeline programs pass
    :mod:`.pipeline_artifact_checks`' own, whose module imports this one), ``check_ranks(metas, directory,
    manifest)`` their agreement (default: none beyond the batch partition).

    Raises:
        ProgramLoadError: as ``check_meta``, ``check_ranks`` and :func:`check_batch_partition`; a missing file.
    """
    d = Path(directory)
    check_meta = check_meta or check_program_meta
    metas = {}
    for r in range(manifest["world_size"]):
        p = d / f"rank{r}" / "program.json"
        meta = safe_load.load_json_file(p, "program file", ProgramLoadError)
        metas[r] = check_meta(meta, p, r, manifest)
    # the ranks' agreement first (its errors name the file), then the compile id over everything
    if check_ranks is not None:
        check_ranks(metas, d, manifest)
    check_batch_partition(metas, d, manifest)
    if "compile_id" in manifest:  # recomputed: an edit of any covered file, field or rank's metadata shows
        covers = manifest.get("compile_covers")
        if not (isinstance(covers, list) and all(isinstance(c, str) and c in manifest["files"] for c in covers)):
            raise ProgramLoadError(f"{str(d / 'manifest.json')!r}: field 'compile_covers' must list files of "
                                   f"'files', got {_short(covers)}; compile again (a hand-edited manifest)")
        got = compile_id({c: manifest["files"][c] for c in covers}, metas, manifest)
        if got != manifest["compile_id"]:
            raise ProgramLoadError(
                f"the programs in {str(d)!r} are not the compile their manifest names (compile id recomputed from "
                f"the files, the manifest's fields and every rank's program.json: {got[:12]}..., the manifest's "
                f"{manifest['compile_id'][:12]}...): a rank from another compile, or an edited file or field; copy "
                "one compile's whole directory, or compile again")
    for name in ("example_batch.safetensors", "plan.json"):  # files adaptdist reads must be hash-checked
        if (d / name).exists() and name not in manifest["files"]:
            raise ProgramLoadError(f"{str(d / name)!r} is not listed in {str(d / 'manifest.json')!r} (an edited "
                                   "manifest?), so its sha256 cannot be checked; compile again")
    return metas
