"""Pipeline programs on disk, and the parts of a run that differ for them (checkpoint view, full weights).

A directory of pipeline programs (``adaptdist train``'s ``OUT/programs``, ``adaptdist compile``'s artifacts)::

    pipeline.json                 {"format", "torch", "world_size", "schedule", "num_stages", "num_microbatches",
                                   "files": {relative path: sha256}}
    plan.json                     the pipeline plan (for reading; the programs carry their own copy)
    rank{r}/pipeline_program.pt   rank r's PipelineRankProgram (torch.save: GraphModules pickle as their code)
    rank{r}/program.py            the code of its prologue and stage programs (forward, backward_input,
                                  backward_weight), to read
    manifest.json                 the artifact manifest of adaptdist.program (format, versions, world size, mesh,
                                  every file's sha256), so ``adaptdist run`` checks a pipeline's artifacts alike

Trust: ``pipeline_program.pt`` is a pickle, so a program directory is code: load only directories you trust; the
sha256 of every file is checked before anything is unpickled.

Checkpoints: each rank saves its own state under its fqns (:class:`CheckpointView` makes a
:class:`~adaptdist.stage_program.PipelineRankProgram` look like a RankProgram to :mod:`.train_state`, with every
rank's fqns and global shapes gathered once), so a pipeline checkpoint holds every tensor once (a tied weight's
identical copies deduplicated) under the same names as any other plan's and loads under another plan, resharded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..errors import ProgramLoadError
from ..stage_program import PipelineRankProgram

MANIFEST = "pipeline.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_pipeline_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds pipeline programs (its ``pipeline.json``)."""
    return (Path(directory) / MANIFEST).is_file()


def save_pipeline_programs(programs: Mapping[int, PipelineRankProgram], directory: str | os.PathLike,
                           extra: dict | None = None, extra_files: dict[str, str | bytes] | None = None) -> Path:
    """Write every rank's pipeline program, ``pipeline.json`` and an artifact ``manifest.json`` (the format of
    :func:`adaptdist.program.save_programs`, ``extra`` fields added, every file's sha256 in it, so that
    ``adaptdist run`` checks these artifacts like any others) into ``directory``; ``extra_files`` (relative path ->
    text or bytes) are written and hashed too. Returns the directory."""
    from .. import program as rank_program
    from .._version import __version__

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for rel, content in sorted((extra_files or {}).items()):
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        files[rel] = _sha256(path)
    world = {p.world_size for p in programs.values()}
    assert len(world) == 1 and sorted(programs) == list(range(next(iter(world)))), sorted(programs)
    for r, prog in sorted(programs.items()):
        rd = d / f"rank{r}"
        rd.mkdir(exist_ok=True)
        torch.save(prog, rd / "pipeline_program.pt")
        files[f"rank{r}/pipeline_program.pt"] = _sha256(rd / "pipeline_program.pt")
        text = [f"# rank {r} of {prog.world_size}: pipeline stage(s) {[st.stage for st in prog.stages]} of "
                f"{prog.stages[0].num_stages}, schedule {prog.schedule}, {prog.num_microbatches} microbatches of "
                f"{prog.microbatch_rows} rows (to read; the rank runs pipeline_program.pt)"]
        if prog.prologue is not None:
            text.append(f"# ---- prologue ----\n{getattr(prog.prologue.module, 'code', '')}")
        for st in prog.stages:
            text += [f"# ---- stage {st.stage} {part} ----\n{getattr(getattr(st, part), 'code', '')}"
                     for part in ("forward", "backward_input", "backward_weight")]
        (rd / "program.py").write_text("\n".join(text))
        files[f"rank{r}/program.py"] = _sha256(rd / "program.py")
    any_prog = programs[0]
    if any_prog.plan is not None and hasattr(any_prog.plan, "to_json"):
        (d / "plan.json").write_text(any_prog.plan.to_json())
        files["plan.json"] = _sha256(d / "plan.json")
    manifest = {"format": FORMAT, "torch": torch.__version__, "world_size": any_prog.world_size,
                "schedule": any_prog.schedule, "num_stages": any_prog.stages[0].num_stages,
                "num_microbatches": any_prog.num_microbatches, "files": files}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
    files[MANIFEST] = _sha256(d / MANIFEST)
    plan = any_prog.plan
    artifact = {"format_version": rank_program.FORMAT_VERSION, "adaptdist_version": __version__,
                "torch_version": torch.__version__, "world_size": any_prog.world_size,
                "mesh": dict(plan.mesh) if plan is not None else {}, "pipeline": True, "files": files,
                **(extra or {})}
    (d / rank_program.MANIFEST).write_text(json.dumps(artifact, indent=1, sort_keys=True))
    return d


def load_pipeline_program(directory: str | os.PathLike, rank: int,
                          world_size: int | None = None) -> PipelineRankProgram:
    """Rank ``rank``'s pipeline program, after checking the manifest and its files' sha256.

    Raises:
        ProgramLoadError: no or a bad manifest, a missing or changed file, another torch version or format, or a
            world size other than ``world_size``; names the file.
    """
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ProgramLoadError(f"{str(d / MANIFEST)!r} cannot be read ({e}); recompile the programs") from None
    if manifest.get("format") != FORMAT or manifest.get("torch") != torch.__version__:
        raise ProgramLoadError(f"pipeline programs in {str(d)!r} are format {manifest.get('format')} for torch "
                               f"{manifest.get('torch')}; this is format {FORMAT}, torch {torch.__version__}: recompile")
    if world_size is not None and manifest["world_size"] != world_size:
        raise ProgramLoadError(f"pipeline programs in {str(d)!r} were compiled for world size "
                               f"{manifest['world_size']}, but this job has {world_size} ranks; recompile for "
                               f"{world_size} ranks")
    rel = f"rank{rank}/pipeline_program.pt"
    digest = manifest["files"].get(rel)
    path = d / rel
    if digest is None or not path.is_file():
        raise ProgramLoadError(f"{str(path)!r} is missing (rank {rank} of {manifest['world_size']}); recompile")
    if _sha256(path) != digest:
        raise ProgramLoadError(f"{str(path)!r} does not match the sha256 in {str(d / MANIFEST)!r} (corrupted or "
                               "edited); recompile")
    program = torch.load(path, weights_only=False)
    if not isinstance(program, PipelineRankProgram) or program.rank != rank:
        raise ProgramLoadError(f"{str(path)!r} is not rank {rank}'s PipelineRankProgram; recompile")
    return program


def describe_pipeline(program: PipelineRankProgram) -> str:
    """``plan 'pp' on mesh pp=2 (2 ranks; schedule 1f1b, 4 microbatches)``: one line for logs."""
    plan = program.plan
    mesh = ",".join(f"{a}={n}" for a, n in (plan.mesh.items() if plan is not None else ()))
    name = plan.name if plan is not None else "?"
    return (f"plan {name!r} on mesh {mesh} ({program.world_size} ranks; schedule {program.schedule}, "
            f"{program.num_microbatches} microbatches)")


@dataclass(frozen=True)
class CheckpointView:
    """What :mod:`.train_state` reads of a RankProgram, for a pipeline rank: its own state names as
    ``input_fqns``, every rank's state (as meta tensors of the global shapes) as ``state`` so that
    ``state_shapes`` covers the whole model, no mesh and no placements (each tensor is saved whole, by the ranks that
    hold it). ``all_param_fqns``: every rank's trainable parameters (a checkpoint's optimizer state for a
    parameter another stage trains is not "unknown")."""

    input_fqns: tuple[str, ...]
    state: Mapping[str, torch.Tensor]
    global_shapes: Mapping[str, tuple[int, ...]]
    param_fqns: tuple[str, ...]
    all_param_fqns: tuple[str, ...]
    plan: Any = None
    description: str = ""
    mesh: Mapping[str, int] = field(default_factory=dict)
    state_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def checkpoint_view(program: PipelineRankProgram) -> CheckpointView:
    """(Collective: one all_gather_object) the :class:`CheckpointView` of this rank's program. State sharded inside a
    stage (tensor parallelism) keeps its placements over the stage's sub-mesh (:func:`stage_device_mesh`)."""
    mine = {f: tuple(program.global_shapes.get(f, tuple(t.shape))) for f, t in program.state.items()}
    dtypes = {f: str(t.dtype) for f, t in program.state.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, dtypes, tuple(program.param_fqns)))
    shapes: dict[str, tuple[int, ...]] = {}
    params: set[str] = set()
    meta: dict[str, torch.Tensor] = {}
    for sh, dt, ps in everyone:
        shapes.update(sh)
        params.update(ps)
        for f, s in sh.items():
            meta[f] = torch.empty(s, dtype=getattr(torch, dt[f].split(".")[-1]), device="meta")
    sharded = bool(program.state_placements)
    return CheckpointView(input_fqns=tuple(sorted(program.state)), state=meta, global_shapes=shapes,
                          param_fqns=tuple(program.param_fqns), all_param_fqns=tuple(sorted(params)),
                          plan=program.plan, mesh=dict(program.stages[0].submesh) if sharded else {},
                          state_placements=dict(program.state_placements))


def stage_device_mesh(program: PipelineRankProgram) -> Any:
    """torch's DeviceMesh over this rank's stage sub-mesh (its ranks, ``stage_ranks`` in sub-mesh order), without
    process groups (enough for torch.distributed.checkpoint to place the shards), or None when no state is sharded
    inside the stage."""
    if not program.state_placements:
        return None
    from .. import _torch_compat as compat

    sub = dict(program.stages[0].submesh)
    ranks = torch.tensor(program.stage_ranks[program.stages[0].stage]).reshape(tuple(sub.values()))
    return compat.device_mesh_without_groups("cpu", ranks, tuple(sub))


def _box(program: PipelineRankProgram, fqn: str, shape: tuple[int, ...]) -> list[list[int]]:
    """``[start, stop)`` per dim of this rank's shard of state ``fqn`` (chunked over the sub-mesh's axes in lowering
    order, as the lowering and ``compiler.artifacts.shard_layout`` do)."""
    from ..mesh import Mesh, lowering_order
    from ..placement import Shard, chunk_interval, parse_placement

    ranges = [[0, n] for n in shape]
    texts = program.state_placements.get(fqn)
    if not texts:
        return ranges
    sub = dict(program.stages[0].submesh)
    coords = dict(program.stages[0].coords)
    by_axis = dict(zip(sub, texts))
    batch_axis = program.plan.batch_axis if program.plan is not None else None
    for a in lowering_order(Mesh(tuple(sub.items())), batch_axis):
        p = parse_placement(by_axis[a])
        if isinstance(p, Shard) and sub[a] > 1:
            lo, hi = ranges[p.dim]
            b, e = chunk_interval(hi - lo, sub[a], coords[a])
            ranges[p.dim] = [lo + b, lo + e]
    return ranges


def gather_full_weights(program: PipelineRankProgram, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """(Collective) every state tensor of the model, whole, on rank 0 (None elsewhere): each rank's own tensors, or
    shards with their boxes, gathered and put together (a tied weight's copies are identical; the first is kept)."""
    own = {}
    for f, t in state.items():
        shape = tuple(program.global_shapes.get(f, tuple(t.shape)))
        own[f] = (t.detach().contiguous(), shape, _box(program, f, shape))
    parts: list[Any] = [None] * dist.get_world_size() if program.rank == 0 else None
    dist.gather_object(own, parts, dst=0)
    if program.rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, set] = {}
    for part in parts:
        for f, (t, shape, box) in part.items():
            if tuple(t.shape) == shape:
                full.setdefault(f, t)
                continue
            if f not in full:
                full[f] = torch.empty(shape, dtype=t.dtype)
                filled[f] = set()
            key = tuple(map(tuple, box))
            if key not in filled.get(f, {key}):
                full[f][tuple(slice(lo, hi) for lo, hi in box)] = t
                filled[f].add(key)
    return full
