"""Pipeline programs on disk: every rank's :class:`~adaptdist.stage_program.PipelineRankProgram`.

The directory follows :mod:`adaptdist.program`'s rules (a manifest with every file's sha256, source code
executed only after its hash matches, tensors as safetensors, nothing pickled)::

    manifest.json              as program.py's, plus "kind": "pipeline"
    plan.json                  the pipeline plan
    rank{r}/program.py         one class per program: Stage{s}Forward, Stage{s}BackwardInput,
                               Stage{s}BackwardWeight (each of the rank's stages), Prologue
    rank{r}/program.json       everything else of the PipelineRankProgram (plain JSON)
    rank{r}/state.safetensors  the rank's state at step 0
    rank{r}/constants.safetensors   tensor constants, as "<Class>.<attribute>" (if any)

``check_artifacts`` (program.py) accepts such a directory: every rank has its ``program.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.fx
from safetensors.torch import load_file, save_file

from . import _torch_compat as compat
from ._version import __version__
from .errors import ProgramLoadError
from .program import FORMAT_VERSION, MANIFEST, _own_memory, _sha256, read_manifest
from .stage_program import PipelineRankProgram, PrologueProgram, StageProgram, TensorSpec

KIND = "pipeline"
_PARTS = (("forward", "Forward"), ("backward_input", "BackwardInput"), ("backward_weight", "BackwardWeight"))


def _source(gm: torch.nn.Module, cls: str) -> str:
    if not isinstance(gm, torch.fx.GraphModule):
        raise ProgramLoadError(f"{cls}: only compiled (GraphModule) programs can be saved, got {type(gm).__name__}")
    src = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    return re.sub(r"^class GraphModule\(torch\.nn\.Module\):", f"class {cls}(torch.nn.Module):", src, count=1,
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
    files: dict[str, str] = {}
    for rel, content in sorted((extra_files or {}).items()):
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        files[rel] = _sha256(path)
    world = {p.world_size for p in programs.values()}
    assert len(world) == 1 and sorted(programs) == list(range(world.pop()))
    for r, prog in sorted(programs.items()):
        rd = d / f"rank{r}"
        rd.mkdir(exist_ok=True)
        sources = [f"# adaptdist {__version__} pipeline program, torch {torch.__version__}: rank {r} of "
                   f"{prog.world_size}, stages {[s.stage for s in prog.stages]} of {prog.stages[0].num_stages}\n"
                   "# Generated code: edit the model, not this file.\nimport torch\nfrom torch import device\n"]
        constants: dict[str, torch.Tensor] = {}
        stages = []
        for st in prog.stages:
            classes = {}
            for attr, suffix in _PARTS:
                cls = f"Stage{st.stage}{suffix}"
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
                "submesh": dict(st.submesh)})
        prologue = None
        if prog.prologue is not None:
            sources.append(_source(prog.prologue.module, "Prologue"))
            constants.update(_constants(prog.prologue.module, "Prologue"))
            prologue = {"class": "Prologue", "reduce_ops": list(prog.prologue.reduce_ops),
                        "names": list(prog.prologue.names)}
        meta = {
            "rank": prog.rank, "world_size": prog.world_size, "stages": stages, "prologue": prologue,
            "num_microbatches": prog.num_microbatches, "microbatch_rows": prog.microbatch_rows,
            "batch_slice": list(prog.batch_slice), "schedule": prog.schedule,
            "stage_ranks": {str(s): list(rs) for s, rs in prog.stage_ranks.items()},
            "batch_group": list(prog.batch_group),
            "grad_groups": {f: list(g) for f, g in prog.grad_groups.items()},
            "groups": {g: list(rs) for g, rs in prog.groups.items()}, "param_fqns": list(prog.param_fqns),
            "global_shapes": {f: list(s) for f, s in prog.global_shapes.items()},
            "state_placements": {f: list(p) for f, p in prog.state_placements.items()}, "loss_rank": prog.loss_rank,
        }
        (rd / "program.py").write_text("\n\n".join(sources))
        (rd / "program.json").write_text(json.dumps(meta, indent=1))
        save_file(_own_memory(dict(prog.state)), str(rd / "state.safetensors"))
        names = ["program.py", "program.json", "state.safetensors"]
        if constants:
            save_file(_own_memory(constants), str(rd / "constants.safetensors"))
            names.append("constants.safetensors")
        for name in names:
            files[f"rank{r}/{name}"] = _sha256(rd / name)
    first = programs[0]
    if first.plan is not None:
        (d / "plan.json").write_text(first.plan.to_json())
        files["plan.json"] = _sha256(d / "plan.json")
    manifest = {"format_version": FORMAT_VERSION, "adaptdist_version": __version__, "torch_version": torch.__version__,
                "world_size": first.world_size, "mesh": dict(first.plan.mesh) if first.plan is not None else {},
                "kind": KIND, "files": files, **(extra or {})}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return d


def is_pipeline_directory(directory: str | os.PathLike) -> bool:
    """Whether ``directory``'s manifest says it holds pipeline programs (False: none, or rank programs)."""
    p = Path(directory) / MANIFEST
    try:
        return json.loads(p.read_text()).get("kind") == KIND
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def load_pipeline_program(directory: str | os.PathLike, rank: int, world_size: int | None = None
                          ) -> PipelineRankProgram:
    """Load rank ``rank``'s pipeline program after checking the manifest and its files' sha256.

    Its programs are plain modules (called like the GraphModules they were saved from).

    Raises:
        ProgramLoadError: not a pipeline directory, a missing file, a hash mismatch, a format/torch version
            mismatch, or a world size other than ``world_size``; names the file.
    """
    d = Path(directory)
    manifest = read_manifest(d)
    if manifest.get("kind") != KIND:
        raise ProgramLoadError(f"{str(d)!r} holds rank programs, not pipeline programs (its manifest has no "
                               f"\"kind\": \"{KIND}\"); load it with adaptdist.program.load_program")
    if world_size is not None and manifest["world_size"] != world_size:
        raise ProgramLoadError(f"programs in {str(d)!r} were compiled for world size {manifest['world_size']}, but this "
                               f"job has {world_size} ranks; recompile for {world_size} ranks")
    if not 0 <= rank < manifest["world_size"]:
        raise ProgramLoadError(f"rank {rank} is outside world size {manifest['world_size']} of {str(d)!r}")
    prefix = f"rank{rank}/"
    mine = {k: v for k, v in manifest["files"].items() if k.startswith(prefix) or k == "plan.json"}
    for name in ("program.py", "program.json", "state.safetensors"):
        if prefix + name not in mine:
            raise ProgramLoadError(f"{str(d / MANIFEST)!r} lists no {prefix}{name}; recompile the programs")
    for rel, digest in sorted(mine.items()):
        p = d / rel
        if not p.is_file():
            raise ProgramLoadError(f"{str(p)!r} is listed in the manifest but missing")
        if _sha256(p) != digest:
            raise ProgramLoadError(f"{str(p)!r} does not match the sha256 in {str(d / MANIFEST)!r} (corrupted or "
                                   "edited); recompile")
    meta = json.loads((d / prefix / "program.json").read_text())
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
        submesh=s["submesh"]) for s in meta["stages"])
    pro = meta["prologue"]
    prologue = (PrologueProgram(module(pro["class"]), tuple(pro["reduce_ops"]), tuple(pro["names"]))
                if pro is not None else None)
    plan = None
    if "plan.json" in manifest["files"]:
        from .plan import Plan
        plan = Plan.load(d / "plan.json")
    return PipelineRankProgram(
        rank=meta["rank"], world_size=meta["world_size"], stages=stages, prologue=prologue,
        num_microbatches=meta["num_microbatches"], microbatch_rows=meta["microbatch_rows"],
        batch_slice=tuple(meta["batch_slice"]), schedule=meta["schedule"],
        stage_ranks={int(s): tuple(rs) for s, rs in meta["stage_ranks"].items()},
        batch_group=tuple(meta["batch_group"]), grad_groups={f: tuple(g) for f, g in meta["grad_groups"].items()},
        groups={g: tuple(rs) for g, rs in meta["groups"].items()}, state=load_file(str(d / prefix / "state.safetensors")),
        param_fqns=tuple(meta["param_fqns"]), global_shapes={f: tuple(s) for f, s in meta["global_shapes"].items()},
        state_placements={f: tuple(p) for f, p in meta["state_placements"].items()}, loss_rank=meta["loss_rank"],
        plan=plan)
