"""RankProgram: what one rank runs, and its on-disk format.

A program directory holds::

    manifest.json              format version, adaptdist/torch versions, world size,
                               mesh, sha256 of every other file
    rank{r}/program.py         the rank's generated Python source (local shapes as comments)
    rank{r}/program.json       inputs, outputs, local batch slice (plain JSON)
    rank{r}/state.safetensors  the parameters and buffers the rank holds at step 0
    rank{r}/constants.safetensors   tensor constants the code refers to (if any)

Rules that stay: the program is stored as source and executed only after its
hash matches the manifest; tensors are stored as safetensors; nothing is
pickled. Artifacts are code: the hashes catch corruption and mix-ups, not a
malicious author; load programs only from sources you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.fx
from safetensors.torch import load_file, save_file

from ._version import __version__
from . import _torch_compat as compat
from .artifact_checks import PIPELINE_KIND, check_compile, check_manifest, check_program_meta, compile_id
from .errors import ProgramLoadError
from .safe_load import load_json_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class RankProgram:
    """One rank's training-step program.

    Calling it runs one step: ``program(*state, *local_batch)`` returns the
    outputs named by ``output_roles`` (``"buffer:<fqn>"``, ``"loss"``, ``"grad:<fqn>"``).

    Attributes:
        rank, world_size: this rank and the number of ranks.
        mesh: mesh axis name -> size, e.g. ``{"dp": 2}``.
        group_names: mesh axis name -> process-group name used by the code's collectives.
        input_fqns: names of the state inputs (params, frozen params, buffers), in order.
        param_fqns: the trainable parameters among them (the optimizer's), in order.
        num_batch_inputs: number of batch tensors after the state inputs.
        batch_slice: ``(offset, size)`` of this rank's rows of the global batch.
        output_roles: role of each output.
        code: the generated source (``program.py``).
        module: the callable (a GraphModule when compiled, the exec'd source when loaded).
        state: initial tensors by fqn, the rank's own shard (full tensors under DP).
        state_placements: fqn -> placement text per mesh axis (e.g. ``["R", "S(0)"]``) of each
            sharded state tensor; a dim sharded on several axes is chunked in lowering order
            (model-parallel axes first, then the batch axis).
        global_shapes: fqn -> global (unsharded) shape of each state tensor.
        plan: the :class:`~adaptdist.plan.Plan` the program was lowered from (``plan.json``).
        constants: tensor constants the code reads as attributes.
        comm: the ``--comm`` it was lowered under (``"auto"``, ``"shm"``, ``"gloo"``; ``""``: not recorded, programs
            saved before it was): under ``auto`` an axis whose shared-memory group cannot be made at the start goes
            to gloo (:func:`adaptdist.runtime.worker.register_mesh_groups`); otherwise that is an error.
    """

    rank: int
    world_size: int
    mesh: dict[str, int]
    group_names: dict[str, str]
    input_fqns: list[str]
    param_fqns: list[str]
    num_batch_inputs: int
    batch_slice: tuple[int, int]
    output_roles: list[str]
    code: str
    module: torch.nn.Module
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    stacked: dict[str, list[str]] = field(default_factory=dict)  # ModuleList experts: stacked name -> user names
    notes: list[str] = field(default_factory=list)  # capture's notes (ModuleLists not taken as experts), not saved
    batch_specs: list[tuple[list[int], str]] = field(default_factory=list)
    state_placements: dict[str, list[str]] = field(default_factory=dict)
    global_shapes: dict[str, list[int]] = field(default_factory=dict)
    plan: Any = None
    comm: str = ""
    _traced: torch.fx.GraphModule | None = field(default=None, repr=False)

    def __call__(self, *args: torch.Tensor):
        return self.module(*args)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The program's ATen graph: the compiled one, or (after loading) a re-trace on fake tensors."""
        if isinstance(self.module, torch.fx.GraphModule):
            return self.module
        if self._traced is None:
            specs = [(list(self.state[f].shape), self.state[f].dtype) for f in self.input_fqns]
            specs += [(shape, getattr(torch, dtype)) for shape, dtype in self.batch_specs]
            self._traced = compat.trace_fake(self.module, specs, code_device(self.code))
        return self._traced

    @property
    def loss_index(self) -> int:
        return self.output_roles.index("loss")

    def local_batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """This rank's rows of a global batch (dim 0)."""
        off, size = self.batch_slice
        return tuple(t[off:off + size] for t in batch)

    def collectives(self) -> list[str]:
        """The collectives this program issues, in order, as ``op(group, numel)`` strings (functional collectives and
        adaptdist's shared-memory ones)."""
        from .comm_transport import is_shm_collective

        gm = self.graph_module
        out = []
        for n in gm.graph.nodes:
            if n.op == "call_function" and (compat.is_functional_collective(n.target) or is_shm_collective(n.target)):
                ins = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]  # a fused bucket: a list
                out.append(f"{n.target}({n.args[-1]}, {sum(a.meta['val'].numel() for a in ins)})")
        return out

    def __str__(self) -> str:
        return self.code

    def _meta(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "mesh": self.mesh,
            "group_names": self.group_names,
            "input_fqns": self.input_fqns,
            "param_fqns": self.param_fqns,
            "num_batch_inputs": self.num_batch_inputs,
            "batch_slice": list(self.batch_slice),
            "output_roles": self.output_roles,
            "tied": self.tied,
            **({"stacked": self.stacked} if self.stacked else {}),
            "constants": sorted(self.constants),
            "batch_specs": [[list(shape), dtype] for shape, dtype in self.batch_specs],
            "state_placements": self.state_placements,
            "global_shapes": self.global_shapes,
            **({"comm": self.comm} if self.comm else {}),
        }


@dataclass
class SplitProgram:
    """The two parts of a joint program (:func:`adaptdist.compiler.partition.split_forward_backward`).

    Attributes:
        forward: ``forward(*placeholders it uses)`` -> ``(*forward outputs, *saved)``.
        backward: ``backward(*saved, *placeholders it uses)`` -> the other outputs.
        forward_inputs / backward_inputs: indices of the joint program's placeholders each part takes
            (after the saved values, for the backward).
        forward_roles / backward_roles: the output roles of each part (saved values excluded).
        num_saved: how many values the forward part returns after its outputs.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    forward_inputs: list[int]
    backward_inputs: list[int]
    forward_roles: list[str]
    backward_roles: list[str]
    num_saved: int


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _own_memory(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` contiguous, each in memory of its own: safetensors refuses tensors that share memory
    (two buffers registered from one tensor, a batch holding one tensor twice); only those are copied."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if v.numel() and ptr in seen:
            v = v.clone()
        seen.add(ptr)
        out[k] = v
    return out


def write_extra_files(d: Path, extra_files: Mapping[str, str | bytes] | None) -> dict[str, str]:
    """Write ``extra_files`` (relative path -> text or bytes) under ``d``; returns relative path -> sha256."""
    files: dict[str, str] = {}
    for rel, content in sorted((extra_files or {}).items()):
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        files[rel] = _sha256(path)
    return files


def seal_programs(d: Path, files: dict[str, str], metas: Mapping[int, dict], manifest: dict) -> dict:
    """Finish a program directory (rank programs or pipeline programs): the compile id over ``files`` (every file
    written so far), ``manifest``'s fields and every rank's metadata ``metas`` (adaptdist.artifact_checks: a
    directory mixed from two compiles, or edited, is refused), written into each ``rank{r}/program.json``, then
    ``manifest.json`` with every file's sha256. Returns the manifest written."""
    covers = sorted(files)
    cid = compile_id({f: files[f] for f in covers}, metas, manifest)
    for r in sorted(metas):
        (d / f"rank{r}" / "program.json").write_text(json.dumps(dict(metas[r], compile_id=cid), indent=1))
        files[f"rank{r}/program.json"] = _sha256(d / f"rank{r}" / "program.json")
    manifest = dict(manifest, compile_id=cid, compile_covers=covers, files=files)
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def save_programs(programs: dict[int, RankProgram], directory: str | os.PathLike, extra: dict | None = None,
                  extra_files: dict[str, str | bytes] | None = None) -> Path:
    """Write all ranks' programs and a manifest to ``directory``; returns its path. ``extra`` adds manifest
    fields; ``extra_files`` (relative path -> text or bytes) adds files, hashed in the manifest like the rest."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = write_extra_files(d, extra_files)
    world = {p.world_size for p in programs.values()}
    assert len(world) == 1 and sorted(programs) == list(range(world.pop()))
    for r, prog in sorted(programs.items()):
        rd = d / f"rank{r}"
        rd.mkdir(exist_ok=True)
        (rd / "program.py").write_text(prog.code)
        save_file(_own_memory(prog.state), str(rd / "state.safetensors"))
        names = ["program.py", "state.safetensors"]
        if prog.constants:
            save_file(_own_memory(prog.constants), str(rd / "constants.safetensors"))
            names.append("constants.safetensors")
        for name in names:
            files[f"rank{r}/{name}"] = _sha256(rd / name)
    any_prog = programs[0]
    if any_prog.plan is not None:
        (d / "plan.json").write_text(any_prog.plan.to_json())
        files["plan.json"] = _sha256(d / "plan.json")
    manifest = {
        "format_version": FORMAT_VERSION,
        "adaptdist_version": __version__,
        "torch_version": torch.__version__,
        "world_size": any_prog.world_size,
        "mesh": any_prog.mesh,
        **_transport_fields(programs),
        **(extra or {}),
    }
    seal_programs(d, files, {r: prog._meta() for r, prog in programs.items()}, manifest)
    return d


def _transport_fields(programs: dict[int, RankProgram]) -> dict:
    """The manifest's ``transports`` (mesh axis -> ``shm`` | ``gloo`` | ``none``) and ``kernels`` (``["shm"]`` when a
    program calls adaptdist's shared-memory ops, so a machine without them refuses the artifacts: :func:`check_kernels`)."""
    from .comm_transport import transports_of_code

    transports: dict[str, str] = {}
    for prog in programs.values():
        for axis, t in transports_of_code(prog.code, prog.group_names, prog.mesh).items():
            transports[axis] = "shm" if t == "shm" or transports.get(axis) == "shm" else t
    return {"transports": transports, **({"kernels": ["shm"]} if "shm" in transports.values() else {})}


def check_kernels(manifest: dict, directory: str | os.PathLike) -> None:
    """Refuse artifacts whose programs call adaptdist's C++ kernels (``manifest["kernels"]``) where they cannot be
    loaded.

    Raises:
        ShmUnavailableError: names the directory, why the kernels are unavailable and what to do.
    """
    if "shm" not in (manifest.get("kernels") or []):
        return
    from .kernels import require

    axes = [a for a, t in (manifest.get("transports") or {}).items() if t == "shm"]
    require(f"{str(directory)!r} (compiled with shared-memory collectives on mesh axes {axes})",
            "Compile it again with --comm gloo to run it here")


def read_manifest(directory: str | os.PathLike) -> dict:
    """Read and check the manifest's format and torch version.

    Raises:
        ProgramLoadError: missing or unreadable manifest, other format version or torch version.
    """
    d = Path(directory)
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise ProgramLoadError(f"{str(mpath)!r} does not exist; is {str(d)!r} a directory written by adaptdist?")
    manifest = load_json_file(mpath, "manifest", ProgramLoadError)  # bounded: adaptdist/limits.py
    if not isinstance(manifest, dict):
        raise ProgramLoadError(f"{str(mpath)!r} must hold a JSON object, got {type(manifest).__name__}; recompile")
    for key in ("format_version", "torch_version", "world_size", "files"):
        if key not in manifest:
            raise ProgramLoadError(f"{str(mpath)!r} lacks the field {key!r}; recompile the programs")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ProgramLoadError(
            f"{str(mpath)!r} has format version {manifest['format_version']}, this adaptdist reads "
            f"{FORMAT_VERSION}; recompile the programs with this adaptdist"
        )
    if manifest["torch_version"] != torch.__version__:
        raise ProgramLoadError(
            f"{str(mpath)!r} was written with torch {manifest['torch_version']}, this is torch "
            f"{torch.__version__}; recompile the programs with this torch"
        )
    return check_manifest(manifest, mpath)  # every field type-checked (adaptdist.artifact_checks)


def read_rank_manifest(d: Path, rank: int, world_size: int | None) -> dict:
    """:func:`read_manifest`, and rank ``rank`` of a job of ``world_size`` ranks (None: any) can load from it.

    Raises:
        ProgramLoadError: as :func:`read_manifest`; another world size; a rank outside it.
    """
    manifest = read_manifest(d)
    if world_size is not None and manifest["world_size"] != world_size:
        raise ProgramLoadError(
            f"programs in {str(d)!r} were compiled for world size {manifest['world_size']}, "
            f"but this job has {world_size} ranks; recompile for {world_size} ranks"
        )
    if not 0 <= rank < manifest["world_size"]:
        raise ProgramLoadError(f"rank {rank} is outside world size {manifest['world_size']} of {str(d)!r}")
    return manifest


def check_rank_files(d: Path, manifest: Mapping[str, Any], rank: int | None) -> dict[str, str]:
    """Check that rank ``rank``'s files (``rank{r}/program.py``, ``program.json``, ``state.safetensors`` listed, and
    everything under ``rank{r}/`` the manifest lists present and matching its sha256); ``rank`` None: ``plan.json``.
    Returns the checked files' relative paths -> sha256.

    Raises:
        ProgramLoadError: a file not listed, missing or changed; names it.
    """
    if rank is None:
        mine = {k: v for k, v in manifest["files"].items() if k == "plan.json"}
    else:
        prefix = f"rank{rank}/"
        mine = {k: v for k, v in manifest["files"].items() if k.startswith(prefix)}
        for name in ("program.py", "program.json", "state.safetensors"):
            if prefix + name not in mine:
                raise ProgramLoadError(f"{str(d / MANIFEST)!r} lists no {prefix}{name}; recompile the programs")
    for rel, digest in sorted(mine.items()):
        p = d / rel
        if not p.is_file():
            raise ProgramLoadError(f"{str(p)!r} is listed in the manifest but missing")
        if _sha256(p) != digest:
            raise ProgramLoadError(
                f"{str(p)!r} does not match the sha256 in {str(d / MANIFEST)!r} (corrupted or edited); recompile"
            )
    return mine


def load_program(directory: str | os.PathLike, rank: int, world_size: int | None = None) -> RankProgram:
    """Load rank ``rank``'s program after checking the manifest and every file's sha256.

    Raises:
        ProgramLoadError: a missing file, a hash mismatch, a format/torch version
            mismatch, or a world size other than ``world_size``; names the file.
    """
    d = Path(directory)
    manifest = read_rank_manifest(d, rank, world_size)
    mine = check_rank_files(d, manifest, rank)
    prefix = f"rank{rank}/"
    meta_path = d / prefix / "program.json"  # typed, and from the manifest's compile (check_artifacts: all ranks)
    meta = check_program_meta(load_json_file(meta_path, "program file", ProgramLoadError), meta_path, rank, manifest)
    plan = None
    if "plan.json" in manifest["files"]:
        from .plan import Plan

        check_rank_files(d, manifest, None)
        plan = Plan.load(d / "plan.json")
    code = (d / prefix / "program.py").read_text()
    module = module_from_source(code, str(d / prefix / "program.py"))
    constants = {}
    if prefix + "constants.safetensors" in mine:
        constants = load_file(str(d / prefix / "constants.safetensors"))
        for k, v in constants.items():
            setattr(module, k, v)
    state = load_file(str(d / prefix / "state.safetensors"))
    return RankProgram(
        rank=meta["rank"], world_size=meta["world_size"], mesh=meta["mesh"], group_names=meta["group_names"],
        input_fqns=meta["input_fqns"], param_fqns=meta["param_fqns"], num_batch_inputs=meta["num_batch_inputs"],
        batch_slice=tuple(meta["batch_slice"]), output_roles=meta["output_roles"], code=code, module=module,
        state=state, constants=constants, tied=meta.get("tied", {}), stacked=meta.get("stacked", {}),
        batch_specs=[(list(shape), dtype) for shape, dtype in meta["batch_specs"]],
        state_placements=meta.get("state_placements", {}), global_shapes=meta.get("global_shapes", {}),
        plan=plan, comm=meta.get("comm") if isinstance(meta.get("comm"), str) else "",
    )


def module_from_source(code: str, filename: str) -> torch.nn.Module:
    """Execute generated program source and instantiate its ``RankProgramModule`` class."""
    namespace = compat.fx_code_globals()
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - hash-checked generated code
    return namespace["RankProgramModule"]()


def check_artifacts(directory: str | Path, cluster: Any | None) -> dict:
    """Check an artifact directory before running it; returns its manifest.

    Every file in the manifest must exist and match its sha256; the format and torch versions must
    be this adaptdist's and torch's; with ``cluster``, its world size and topology fingerprint must be
    the manifest's.

    Raises:
        ProgramLoadError: names the file and what differs.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ProgramLoadError(f"{str(d)!r} is not a directory; pass the -o directory of `adaptdist compile`")
    manifest = read_manifest(d)
    for rel, digest in sorted(manifest["files"].items()):
        p = d / rel
        if not p.is_file():
            raise ProgramLoadError(f"{str(p)!r} is listed in {str(d / 'manifest.json')!r} but missing; copy the "
                                   "whole directory, or compile again")
        if _sha256(p) != digest:
            raise ProgramLoadError(f"{str(p)!r} does not match its sha256 in {str(d / 'manifest.json')!r} "
                                   "(corrupted or edited); compile again")
    for r in range(manifest["world_size"]):
        for name in ("program.py", "program.json", "state.safetensors"):
            if f"rank{r}/{name}" not in manifest["files"]:
                raise ProgramLoadError(f"{str(d / 'manifest.json')!r} lists no rank{r}/{name} for world size "
                                       f"{manifest['world_size']}; compile again")
    check_kernels(manifest, d)  # before any rank starts (adaptdist run)
    # every rank from one compile, the batch slices a partition; pipeline programs: the stages' peers agree too
    if manifest.get("kind") == PIPELINE_KIND:  # pipeline programs' program.json (stage_program_io) has its own fields
        from .pipeline_artifact_checks import check_pipeline_meta, check_pipeline_ranks

        check_compile(d, manifest, check_pipeline_meta, check_pipeline_ranks)
    else:
        check_compile(d, manifest)
    if cluster is not None:
        if cluster.world_size != manifest["world_size"]:
            raise ProgramLoadError(
                f"{str(d)!r} was compiled for {manifest['world_size']} ranks, this cluster has {cluster.world_size} "
                f"({cluster!r}); compile again for this cluster")
        want = manifest.get("cluster_fingerprint")
        got = cluster.topology_fingerprint()
        if want is not None and want != got:
            hosts = manifest.get("cluster_hosts", [])
            raise ProgramLoadError(
                f"{str(d)!r} was compiled for another cluster topology (fingerprint {want}: hosts "
                f"{', '.join(f'{h}: {n} x {k}' for h, n, k in hosts)}), this is {cluster!r} (fingerprint {got}); "
                "compile again for this cluster, or pass the cluster file it was compiled for with --cluster")
    return manifest


def check_model_file(manifest: dict, directory: str | Path) -> None:
    """The model file recorded in an artifact manifest, when it is still there, must be the file compiled (its
    sha256): its ``data()`` feeds the run, and a changed file means the artifacts may no longer be its model.

    Raises:
        ProgramLoadError: the file's sha256 differs from the manifest's; names both digests.
    """
    want = manifest.get("model_file_sha256")
    path = Path(manifest.get("model_file") or "")
    if not want or not path.is_file():
        return
    got = _sha256(path)
    if got != want:
        raise ProgramLoadError(f"the model file {str(path)!r} changed since {str(directory)!r} was compiled (sha256 "
                               f"{got[:12]}..., the manifest holds {want[:12]}...); compile again, or restore the file")


def code_device(code: str) -> torch.device:
    """The device rank-program source names in its device arguments (the first one; cpu where it names none): the
    device its inputs must be on for the code to trace (:func:`adaptdist.runtime.devices.retarget_code` writes them)."""
    m = re.search(r"device\(type='(cpu|cuda|meta)'(?:, index=(\d+))?\)", code)
    if m is None:
        return torch.device("cpu")
    return torch.device(m.group(1), int(m.group(2))) if m.group(2) else torch.device(m.group(1))
