"""Checks of a pipeline program directory's meaning (manifest ``kind: pipeline``, :mod:`adaptdist.stage_program_io`),
beyond its hashes; the pipeline counterpart of :func:`adaptdist.artifact_checks.check_program_meta`:

- every rank's ``program.json`` is type-checked field by field (a hand edit gives a :class:`ProgramLoadError` naming
  the file and the field), says the rank and world size the manifest says, carries the manifest's ``compile_id``,
  and records the sha256 of the rank's other files as the manifest lists them (an edited or replaced
  ``program.py``/``state.safetensors`` is named even when the manifest was rehashed to match);
- the ranks agree (:func:`check_pipeline_ranks`): one schedule, microbatch count and stage layout; each stage's
  sends go to a rank that holds the next stage and receives from it, with the same tensor specs (a mismatch would
  otherwise hang or fail mid-step); each gradient and batch group's members name the same group.

All before any program is executed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from .artifact_checks import _Fields, _is_int_list, _short, check_compile_id
from .errors import ProgramLoadError

PARTS = (("forward", "Forward"), ("backward_input", "BackwardInput"), ("backward_weight", "BackwardWeight"))
"""A stage's three programs: ``program.json``'s key and the class name suffix in ``program.py``."""

SPEC_KEYS = ("recv_specs", "send_specs", "grad_in_specs", "grad_out_specs")


def stage_class(stage: int, suffix: str) -> str:
    """``Stage{stage}{suffix}``: the class of one of a stage's programs in ``program.py``."""
    return f"Stage{stage}{suffix}"


def _ranks(f: _Fields, name: str, v: Any, world: int) -> list[int]:
    if not (_is_int_list(v) and all(x < world for x in v)):
        raise f.fail(name, f"must be a list of ranks 0..{world - 1}, got {_short(v)}")
    return v


def _specs(f: _Fields, name: str, v: Any) -> None:
    ok = isinstance(v, list) and all(
        isinstance(s, list) and len(s) == 2 and _is_int_list(s[0]) and isinstance(s[1], str)
        and isinstance(getattr(torch, s[1], None), torch.dtype) for s in v)
    if not ok:
        raise f.fail(name, f"must be a list of [[shape], dtype] pairs (torch dtype names), got {_short(v)}")


def _check_stage(f: _Fields, i: int, doc: Any, world: int) -> dict:
    where = f"stages[{i}]"
    if not isinstance(doc, dict):
        raise f.fail(where, f"must be an object, got {_short(doc)}")
    sf = _Fields(doc, f"{f.source} {where}")
    s = sf.int("stage", 0)
    n = sf.int("num_stages", s + 1)
    want = {attr: stage_class(s, suffix) for attr, suffix in PARTS}
    if sf.need("classes") != want:
        raise sf.fail("classes", f"must be {want} (the classes of program.py), got {_short(doc['classes'])}")
    for key in ("state_names", "grad_fqns", "layers"):
        sf.str_list(key)
    for key in SPEC_KEYS:
        _specs(sf, key, sf.need(key))
    for key, end in (("recv_from", s == 0), ("send_to", s == n - 1)):
        v = sf.need(key)
        if end and v is not None:
            raise sf.fail(key, f"must be null at the pipeline's end (stage {s} of {n}), got {_short(v)}")
        if not end:
            sf.int(key, 0, world - 1)
    for key in ("num_saved", "num_saved_w"):
        sf.int(key, 0)
    sf.str_map("coords", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "indices >= 0")
    sf.str_map("submesh", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "axis sizes >= 1")
    return doc


def check_pipeline_meta(meta: object, path: Path, rank: int, manifest: Mapping[str, Any]) -> dict:
    """Type-check rank ``rank``'s parsed pipeline ``program.json`` (``path``) and match it to the manifest; returns
    it.

    Raises:
        ProgramLoadError: a field missing or malformed, another rank, world size or compile than the manifest's, or
            a file of the rank whose sha256 is not the one recorded at compile time; names the file and the field.
    """
    from .pipeline_schedules import SCHEDULES

    f = _Fields(meta, repr(str(path)))
    world = manifest["world_size"]
    if f.int("rank", 0) != rank:
        raise f.fail("rank", f"is {meta['rank']}, but the file is rank {rank}'s")  # type: ignore[index]
    if f.int("world_size", 1) != world:
        raise f.fail("world_size", f"is {meta['world_size']}, the manifest's is {world}")  # type: ignore[index]
    check_compile_id(f.doc, path, manifest)
    mb = f.int("num_microbatches", 1)
    rows = f.int("microbatch_rows", 1)
    sl = f.need("batch_slice")
    if not (_is_int_list(sl) and len(sl) == 2):
        raise f.fail("batch_slice", f"must be [first row, rows] (integers >= 0), got {_short(sl)}")
    if sl[1] != mb * rows:
        raise f.fail("batch_slice", f"gives {sl[1]} rows, but num_microbatches x microbatch_rows is {mb} x {rows}")
    stride = f.int("microbatch_stride", 0) if f.has("microbatch_stride") else 0
    if 0 < stride < rows:
        raise f.fail("microbatch_stride", f"is {stride}, fewer than microbatch_rows {rows} (0: contiguous rows)")
    if f.need("schedule") not in SCHEDULES:
        raise f.fail("schedule", f"must be one of {list(SCHEDULES)}, got {_short(f.need('schedule'))}")
    stages = f.need("stages")
    if not (isinstance(stages, list) and stages):
        raise f.fail("stages", f"must be a non-empty list, got {_short(stages)}")
    for i, st in enumerate(stages):
        _check_stage(f, i, st, world)
    if len({st["num_stages"] for st in stages}) != 1 or [st["stage"] for st in stages] != sorted(
            {st["stage"] for st in stages}):
        raise f.fail("stages", "must be distinct stages of one pipeline, in increasing order")
    sr = f.str_map("stage_ranks", lambda v: _is_int_list(v) and all(x < world for x in v) and v != [],
                   f"non-empty lists of ranks 0..{world - 1}")
    n = stages[0]["num_stages"]
    if sorted(sr) != sorted(str(s) for s in range(n)):
        raise f.fail("stage_ranks", f"must name stages 0..{n - 1}, got {sorted(sr)}")
    mine = [s for s in range(n) if rank in sr[str(s)]]
    if mine != [st["stage"] for st in stages]:
        raise f.fail("stages", f"are {[st['stage'] for st in stages]}, but stage_ranks places rank {rank} on {mine}")
    if rank not in _ranks(f, "batch_group", f.need("batch_group"), world):
        raise f.fail("batch_group", f"must include rank {rank}")
    for key in ("grad_groups", "groups") + (("shm_groups",) if f.has("shm_groups") else ()):
        groups = f.str_map(key, lambda v: _is_int_list(v) and all(x < world for x in v), f"lists of ranks 0..{world - 1}")
        for name, g in groups.items():
            if rank not in g:
                raise f.fail(f"{key}[{name!r}]", f"is {g}, which must include rank {rank}")
    params = f.str_list("param_fqns")
    for st in stages:
        extra = sorted(set(st["grad_fqns"]) - set(params))
        if extra:
            raise f.fail("stages", f"stage {st['stage']}'s grad_fqns name {extra[:5]}, which are not in param_fqns")
    f.str_map("global_shapes", _is_int_list, "shapes (lists of integers >= 0)")
    f.str_map("state_placements", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "lists of placement texts")
    if not isinstance(f.need("loss_rank"), bool) or f.need("loss_rank") != (n - 1 in mine):
        raise f.fail("loss_rank", f"must be {n - 1 in mine} (whether rank {rank} holds the last stage), got "
                                  f"{_short(f.need('loss_rank'))}")
    pro = f.need("prologue")
    if pro is not None:
        pf = _Fields(pro, f"{f.source} prologue")
        if pf.need("class") != "Prologue":
            raise pf.fail("class", f"must be 'Prologue', got {_short(pro['class'])}")
        if not (isinstance(pf.need("reduce_ops"), list) and all(o in ("sum", "max", "min") for o in pro["reduce_ops"])):
            raise pf.fail("reduce_ops", f"must list 'sum', 'max' or 'min' per output, got {_short(pro['reduce_ops'])}")
        pf.str_list("names")
    recorded = f.str_map("files", lambda v: isinstance(v, str), "sha256 digests")
    listed = {k.split("/", 1)[1]: v for k, v in manifest["files"].items()
              if k.startswith(f"rank{rank}/") and k != f"rank{rank}/program.json"}
    for name in sorted(set(recorded) | set(listed)):
        if recorded.get(name) != listed.get(name):
            raise ProgramLoadError(
                f"{str(path.parent / name)!r} is not the file compiled with {str(path)!r} (sha256 "
                f"{str(listed.get(name, 'not listed'))[:12]}... in the manifest, {str(recorded.get(name, 'none'))[:12]}"
                f"... recorded at compile time): edited or replaced after the compile; compile again")
    return meta  # type: ignore[return-value]


def _check_routes(r: int, st: Mapping[str, Any], by_rank: Mapping[int, Mapping[int, Any]], fail) -> None:
    """Rank ``r``'s stage ``st`` (routed: stages of different sizes) and the next stage's ranks agree: every piece
    ``r`` sends (activations) or receives (gradients) is one its peer receives or sends, of the same length."""
    from .stage_routes import StageRoutes

    s = st["stage"]
    mine = StageRoutes.from_doc(st["routes"])
    for kind, theirs in (("send", "recv"), ("grad_in", "grad_out")):
        for i, route in enumerate(getattr(mine, kind)):
            for p in route.pieces:
                nxt = by_rank.get(p.peer, {}).get(s + 1)
                other = StageRoutes.from_doc(nxt["routes"]) if nxt is not None and nxt.get("routes") else None
                back = [x for x in getattr(other, theirs)[i].pieces if x.peer == r] if other is not None and \
                    i < len(getattr(other, theirs)) else []
                if len(back) != 1 or back[0].length != p.length or (back[0].dim is None) != (p.dim is None):
                    raise fail(r, f"stage {s}'s {kind} route of tensor {i} names rank {p.peer}, whose stage {s + 1} "
                                  f"{theirs} route does not match it", p.peer)


def check_pipeline_ranks(metas: Mapping[int, Mapping[str, Any]], directory: Path, manifest: Mapping[str, Any]) -> None:
    """Every rank's pipeline metadata (:func:`check_pipeline_meta`'d) agrees with the others' (module docstring).

    Raises:
        ProgramLoadError: names the rank's file and what differs from which other rank.
    """
    def fail(r: int, why: str, other: int = 0) -> ProgramLoadError:
        files = " and ".join(repr(str(directory / f"rank{q}" / "program.json")) for q in dict.fromkeys((r, other)))
        return ProgramLoadError(f"{files} disagree: rank {r}'s {why}; the directory mixes ranks that do not form one "
                                "pipeline (or a file was edited): copy one compile's whole directory, or compile again")

    m0 = metas[0]
    for r, m in sorted(metas.items()):
        for key in ("schedule", "num_microbatches", "stage_ranks"):  # (rows may differ by replica)
            if m[key] != m0[key]:
                raise fail(r, f"{key} is {_short(m[key])}, rank 0's is {_short(m0[key])}", 0)
    by_rank = {r: {st["stage"]: st for st in m["stages"]} for r, m in metas.items()}
    for r, m in sorted(metas.items()):
        for st in m["stages"]:
            s, q = st["stage"], st["send_to"]
            if q is None:
                continue
            if st.get("routes") is not None:  # stages of different sizes: each piece has its counterpart
                _check_routes(r, st, by_rank, fail)
                continue
            nxt = by_rank[q].get(s + 1)
            if nxt is None or nxt["recv_from"] != r:
                raise fail(r, f"stage {s} sends to rank {q}, which does not receive stage {s + 1}'s input from rank "
                              f"{r}", q)
            for mine, theirs in (("send_specs", "recv_specs"), ("grad_in_specs", "grad_out_specs")):
                if st[mine] != nxt[theirs]:
                    raise fail(r, f"stage {s}'s {mine} {_short(st[mine])} differ from rank {q}'s stage {s + 1} "
                                  f"{theirs} {_short(nxt[theirs])}", q)
        for key, groups in (("grad_groups", m["grad_groups"]), ("batch_group", {"": m["batch_group"]})):
            for name, g in groups.items():
                for q in g:
                    other = metas[q][key] if key == "batch_group" else metas[q]["grad_groups"].get(name)
                    if other is None or sorted(other) != sorted(g):
                        what = f"{key}[{name!r}]" if name else key
                        raise fail(r, f"{what} is {g}, but rank {q}'s is {_short(other)}", q)
        for name, g in (m.get("shm_groups") or {}).items():  # a shared-memory group: every member makes it alike
            for q in g:
                other = (metas[q].get("shm_groups") or {}).get(name)
                if other != g:
                    raise fail(r, f"shm_groups[{name!r}] is {g}, but rank {q}'s is {_short(other)}", q)
