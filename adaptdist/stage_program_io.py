"""Pipeline programs on disk: every rank's :class:`~adaptdist.stage_program.PipelineRankProgram`.

The one format of pipeline programs (``adaptdist train``'s ``OUT/programs``, ``adaptdist compile``'s artifacts, the
elastic re-plans' cache). The directory follows :mod:`adaptdist.program`'s rules and uses its helpers (a manifest
with every file's sha256 and the compile id, source code executed only after its hash matches, tensors as
safetensors, nothing pickled)::

    manifest.json              as program.py's, plus "kind": "pipeline"
    plan.json                  the pipeline plan
    rank{r}/program.py         one class per program: Stage{s}Forward, Stage{s}BackwardInput,
                               Stage{s}BackwardWeight (each of the rank's stages), Prologue
    rank{r}/program.json       everything else of the PipelineRankProgram (plain JSON), the compile id and the
                               sha256 of the rank's other files
    rank{r}/state.safetensors  the rank's state at step 0
    rank{r}/constants.safetensors   tensor constants, as "<Class>.<attribute>" (if any)

``check_artifacts`` (program.py) checks such a directory as it checks rank programs: the hashes, the compile id
recomputed from the files, and what :mod:`adaptdist.pipeline_artifact_checks` checks of every rank's
``program.json`` and of the ranks together.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.fx
from safetensors.torch import load_file, save_file

from . import _torch_compat as compat
from ._version import __version__
from .artifact_checks import PIPELINE_KIND as KIND
from .errors import ProgramLoadError
from .pipeline_artifact_checks import PARTS, check_pipeline_meta, stage_class
from .program import (FORMAT_VERSION, MANIFEST, _own_memory, _sha256, check_rank_files,
                      read_rank_manifest, seal_programs, write_extra_files)
from .safe_load import load_json_file
from .stage_routes import StageRoutes
from .stage_program import PipelineRankProgram, PrologueProgram, StageProgram, TensorSpec


def _source(gm: torch.nn.Module, cls: str) -> str:
    if not isinstance(gm, torch.fx.GraphModule):
        raise ProgramLoadError(f"{cls}: only compiled (GraphModule) programs can be saved, got {type(gm).__name__}")
    src = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    # the top-level class is named after the GraphModule's class (GraphModule, or e.g. "<lambda>" from make_fx)
    return re.sub(r"^class [^\n(]+\(torch\.nn\.Module\):", f"class {cls}(torch.nn.Module):", src, count=1,
                  flags=re.M)


def _constants(gm: torch.nn.Module, cls: str) -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(gm, torch.fx.GraphModule):
        for n in gm.graph.find_nodes(op="get_attr"):
            v = getattr(gm, n.target)
            if isinstance(v, torch.Tensor):
                out[f"{cls}.{n.target}"] = v
    return out


def _specs(specs: tuple[TensorSpec, ...]) -> list:
    return [[list(s.shape), str(s.dtype).removeprefix("torch.")] for s in specs]


def save_pipeline_programs(programs: dict[int, PipelineRankProgram], directory: str | os.PathLike,
                           extra: dict | None = None, extra_files: dict[str, str | bytes] | None = None) -> Path:
    """Write every rank's pipeline program and the manifest to ``directory``; returns its path. ``extra`` adds
    manifest fields; ``extra_files`` (relative path -> text or bytes) adds hashed files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = write_extra_files(d, extra_files)
    metas: dict[int, dict] = {}
    world = {p.world_size for p in programs.values()}
    assert len(world) == 1 and sorted(programs) == list(range(world.pop()))
    for r, prog in sorted(programs.items()):
        rd = d / f"rank{r}"
        rd.mkdir(exist_ok=True)
        sources = [f"# adaptdist {__version__} pipeline program, torch {torch.__version__}: rank {r} of "
                   f"{prog.world_size}, stages {[s.stage for s in prog.stages]} of {prog.stages[0].num_stages}, "
                   f"schedule {prog.schedule}, {prog.num_microbatches} microbatches of {prog.microbatch_rows} rows\n"
                   "# Generated code: edit the model, not this file.\nimport torch\nfrom torch import device\n"]
        constants: dict[str, torch.Tensor] = {}
        stages = []
        for st in prog.stages:
            classes = {}
            for attr, suffix in PARTS:
                cls = stage_class(st.stage, suffix)
                sources.append(_source(getattr(st, attr), cls))
                constants.update(_constants(getattr(st, attr), cls))
                classes[attr] = cls
            stages.append({
                "stage": st.stage, "num_stages": st.num_stages, "classes": classes,
                "state_names": list(st.state_names), "grad_fqns": list(st.grad_fqns),
                "recv_specs": _specs(st.recv_specs), "send_specs": _specs(st.send_specs),
                "grad_in_specs": _specs(st.grad_in_specs), "grad_out_specs": _specs(st.grad_out_specs),
                "recv_from": st.recv_from, "send_to": st.send_to, "num_saved": st.num_saved,
                "num_saved_w": st.num_saved_w, "layers": list(st.layers), "coords": dict(st.coords),
                "submesh": dict(st.submesh), "routes": st.routes.to_doc() if st.routes is not None else None})
        prologue = None
        if prog.prologue is not None:
            sources.append(_source(prog.prologue.module, "Prologue"))
            constants.update(_constants(prog.prologue.module, "Prologue"))
            prologue = {"class": "Prologue", "reduce_ops": list(prog.prologue.reduce_ops),
                        "names": list(prog.prologue.names)}
        meta = {
            "rank": prog.rank, "world_size": prog.world_size, "stages": stages, "prologue": prologue,
            "num_microbatches": prog.num_microbatches, "microbatch_rows": prog.microbatch_rows,
            "batch_slice": list(prog.batch_slice), "microbatch_stride": prog.microbatch_stride,
            "schedule": prog.schedule,
            "stage_ranks": {str(s): list(rs) for s, rs in prog.stage_ranks.items()},
            "batch_group": list(prog.batch_group),
            "grad_groups": {f: list(g) for f, g in prog.grad_groups.items()},
            "groups": {g: list(rs) for g, rs in prog.groups.items()}, "param_fqns": list(prog.param_fqns),
            "global_shapes": {f: list(s) for f, s in prog.global_shapes.items()},
            "state_placements": {f: list(p) for f, p in prog.state_placements.items()}, "loss_rank": prog.loss_rank,
        }
        if prog.shm_groups:  # groups on adaptdist's shared-memory kernels (--comm auto|shm)
            meta["shm_groups"] = {g: list(rs) for g, rs in prog.shm_groups.items()}
        if prog.comm:  # the --comm it was lowered under: auto falls back to gloo where a group cannot be made
            meta["comm"] = prog.comm
        if prog.stacked:  # ModuleList experts held stacked: their user names (model.safetensors)
            meta["stacked"] = {f: list(ms) for f, ms in prog.stacked.items()}
        (rd / "program.py").write_text("\n\n".join(sources))
        save_file(_own_memory(dict(prog.state)), str(rd / "state.safetensors"))
        names = ["program.py", "state.safetensors"]
        if constants:
            save_file(_own_memory(constants), str(rd / "constants.safetensors"))
            names.append("constants.safetensors")
        meta["files"] = {name: _sha256(rd / name) for name in names}  # the rank's files, named if one is swapped
        files.update({f"rank{r}/{name}": digest for name, digest in meta["files"].items()})
        metas[r] = meta
    first = programs[0]
    if first.plan is not None:
        (d / "plan.json").write_text(first.plan.to_json())
        files["plan.json"] = _sha256(d / "plan.json")
    transports: dict[str, str] = {}  # mesh axis -> shm if any rank carries it through shared memory
    for prog in programs.values():
        for axis, t in prog.transports().items():
            transports[axis] = "shm" if t == "shm" or transports.get(axis) == "shm" else t
    manifest = {"format_version": FORMAT_VERSION, "adaptdist_version": __version__, "torch_version": torch.__version__,
                "world_size": first.world_size, **({"mesh": dict(first.plan.mesh)} if first.plan is not None else {}),
                "kind": KIND, **({"transports": transports} if transports else {}),
                **({"kernels": ["shm"]} if "shm" in transports.values() else {}), **(extra or {})}
    seal_programs(d, files, metas, manifest)
    return d


def is_pipeline_directory(directory: str | os.PathLike) -> bool:
    """Whether ``directory``'s manifest says it holds pipeline programs (False: none, or rank programs)."""
    p = Path(directory) / MANIFEST
    try:  # bounded (adaptdist/limits.py); a bad manifest is the loader's to name
        doc = load_json_file(p, "manifest", ProgramLoadError)
    except ProgramLoadError:
        return False
    return isinstance(doc, dict) and doc.get("kind") == KIND


def load_pipeline_program(directory: str | os.PathLike, rank: int, world_size: int | None = None
                          ) -> PipelineRankProgram:
    """Load rank ``rank``'s pipeline program after checking the manifest and its files' sha256.

    Its programs are plain modules (called like the GraphModules they were saved from).

    Raises:
        ProgramLoadError: not a pipeline directory, a missing file, a hash mismatch, a format/torch version
            mismatch, or a world size other than ``world_size``; names the file.
    """
    d = Path(directory)
    manifest = read_rank_manifest(d, rank, world_size)
    if manifest.get("kind") != KIND:
        raise ProgramLoadError(f"{str(d)!r} holds rank programs, not pipeline programs (its manifest has no "
                               f"\"kind\": \"{KIND}\"); load it with adaptdist.program.load_program")
    mine = check_rank_files(d, manifest, rank)
    prefix = f"rank{rank}/"
    meta_path = d / prefix / "program.json"  # typed, and from the manifest's compile (check_artifacts: all ranks)
    meta = check_pipeline_meta(load_json_file(meta_path, "program file", ProgramLoadError), meta_path, rank, manifest)
    namespace = compat.fx_code_globals()
    path = d / prefix / "program.py"
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - hash-checked generated code
    constants = load_file(str(d / prefix / "constants.safetensors")) if prefix + "constants.safetensors" in mine else {}

    def module(cls: str) -> torch.nn.Module:
        m = namespace[cls]()
        for k, v in constants.items():
            owner, _, attr = k.partition(".")
            if owner == cls:
                setattr(m, attr, v)
        return m

    def specs(rows: list) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(tuple(shape), getattr(torch, dtype)) for shape, dtype in rows)

    stages = tuple(StageProgram(
        stage=s["stage"], num_stages=s["num_stages"], forward=module(s["classes"]["forward"]),
        backward_input=module(s["classes"]["backward_input"]), backward_weight=module(s["classes"]["backward_weight"]),
        state_names=tuple(s["state_names"]), grad_fqns=tuple(s["grad_fqns"]), recv_specs=specs(s["recv_specs"]),
        send_specs=specs(s["send_specs"]), grad_in_specs=specs(s["grad_in_specs"]),
        grad_out_specs=specs(s["grad_out_specs"]), recv_from=s["recv_from"], send_to=s["send_to"],
        num_saved=s["num_saved"], num_saved_w=s["num_saved_w"], layers=tuple(s["layers"]), coords=s["coords"],
        submesh=s["submesh"], routes=StageRoutes.from_doc(s["routes"]) if s.get("routes") is not None else None)
        for s in meta["stages"])
    pro = meta["prologue"]
    prologue = (PrologueProgram(module(pro["class"]), tuple(pro["reduce_ops"]), tuple(pro["names"]))
                if pro is not None else None)
    plan = None
    if "plan.json" in manifest["files"]:
        from .plan import Plan

        check_rank_files(d, manifest, None)
        plan = Plan.load(d / "plan.json")
    return PipelineRankProgram(
        rank=meta["rank"], world_size=meta["world_size"], stages=stages, prologue=prologue,
        num_microbatches=meta["num_microbatches"], microbatch_rows=meta["microbatch_rows"],
        batch_slice=tuple(meta["batch_slice"]), microbatch_stride=int(meta.get("microbatch_stride", 0)),
        schedule=meta["schedule"], stage_ranks={int(s): tuple(rs) for s, rs in meta["stage_ranks"].items()},
        batch_group=tuple(meta["batch_group"]), grad_groups={f: tuple(g) for f, g in meta["grad_groups"].items()},
        groups={g: tuple(rs) for g, rs in meta["groups"].items()}, state=load_file(str(d / prefix / "state.safetensors")),
        param_fqns=tuple(meta["param_fqns"]), global_shapes={f: tuple(s) for f, s in meta["global_shapes"].items()},
        state_placements={f: tuple(p) for f, p in meta["state_placements"].items()}, loss_rank=meta["loss_rank"],
        plan=plan, stacked=_stacked(meta, meta_path),
        shm_groups={g: tuple(rs) for g, rs in (meta.get("shm_groups") or {}).items()},
        comm=meta.get("comm") if isinstance(meta.get("comm"), str) else "")


def _stacked(meta: dict, path: Path) -> dict[str, tuple[str, ...]]:
    """program.json's optional ``stacked`` ({stacked name: [the experts' names]}).

    Raises:
        ProgramLoadError: it is not a map of names to lists of names.
    """
    got = meta.get("stacked") or {}
    if not (isinstance(got, dict) and all(isinstance(k, str) and isinstance(v, list) and v
                                          and all(isinstance(x, str) for x in v) for k, v in got.items())):
        raise ProgramLoadError(f"{str(path)!r}: field 'stacked' must map names to non-empty lists of names; "
                               "compile again")
    return {k: tuple(v) for k, v in got.items()}
