"""What goes inside a checkpoint directory of a RankProgram run, and loading it resharded.

A checkpoint directory (made by :mod:`.checkpoint_store`: ``prepare`` ... ``commit``) holds, besides the
store's ``meta.json`` and ``manifest.json``::

    dcp/                      torch.distributed.checkpoint of {"model": {state name: tensor},
                              "optim": {parameter name: {"step", "exp_avg", "exp_avg_sq", ...}}}:
                              every tensor as a global DTensor (each shard once; replicated ones once)
    rng/rank{r}.safetensors   rank r's torch RNG states: "cpu" (torch.get_rng_state()) and "cuda{i}" per
                              CUDA device when CUDA was initialized (no pickle)

Because DCP records each tensor's global shape and every saved shard's offset and size, the checkpoint loads
onto any world size, mesh and placements (dp <-> fsdp, another tensor-parallel degree, another mesh shape,
uneven and empty torch.chunk shards): :func:`load_train_state` describes this program's own shards as
DTensors (:func:`~adaptdist.runtime.checkpoint.as_global`) and DCP reads the overlapping parts of the saved
ones into them.

With the store's protocol, on every rank (``runner``: a :class:`~adaptdist.runtime.worker.StepRunner`)::

    tmp = [checkpoint_store.prepare(root, step) if rank == 0 else None]; dist.broadcast_object_list(tmp)
    save_train_state(tmp[0], program, runner.state, runner.opt, device_mesh, rank)   # or async_=True, then
    dist.barrier()                                                                  # fut.result() first
    if rank == 0: checkpoint_store.commit(tmp[0], {"step": step, "state_shapes": state_shapes(program), ...})
    ...
    info = checkpoint_store.latest_good(root, log)                                  # on resume
    load_train_state(info.path, program, runner.state, runner.opt, device_mesh, rank, restore_rng=True)
    check_identical_replicas(program, runner.state, runner.opt, device_mesh)

Trust: DCP's ``.metadata`` is a pickle, so a checkpoint is code, like an artifact: load only checkpoints you
trust; :func:`load_train_state` checks the store's manifest of checksums before DCP reads anything.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..placement import Shard, parse_placement
from ..program import RankProgram
from . import checkpoint_store
from .checkpoint import as_global, ordered_device_mesh

DCP_DIR = "dcp"
RNG_DIR = "rng"


def state_shapes(program: RankProgram) -> dict[str, list[int]]:
    """{state name: global shape} of every state tensor of ``program`` (what meta.json records as
    ``state_shapes`` for :func:`~adaptdist.runtime.checkpoint_store.check_same_model`). A state without a
    recorded global shape (replicated everywhere) has its local shape. ModuleList experts held stacked appear
    under their own names (:func:`expert_rows`)."""
    out = {}
    rows = expert_rows(program)
    for f in _state_names(program):
        shape = list(program.global_shapes.get(f, program.state[f].shape))
        if f in rows:
            out.update({m: shape[1:] for m in program.stacked[f]})
        else:
            out[f] = shape
    return out


def expert_rows(program: RankProgram) -> dict[str, tuple[int, int]]:
    """{stacked name: this rank's rows [lo, hi) of its expert dim} for the ModuleList experts that checkpoints keep
    under the user's names (``moe.experts.3.fc.weight``, each expert whole on the ranks holding it): those whose
    other dims are not sharded. Another placement (an expert's hidden dim split too) keeps the stacked name."""
    stacked = getattr(program, "stacked", None) or {}
    if not stacked:
        return {}
    from ..state_layout import shard_layout

    out = {}
    layout = None
    for f in stacked:
        pls = program.state_placements.get(f, [])
        if any(p not in ("R", "S(0)") for p in pls):
            continue
        if not pls:
            out[f] = (0, len(stacked[f]))
            continue
        layout = layout or shard_layout(program)
        out[f] = tuple(layout[f]["ranges"][0])
    return out


def _by_expert(program: RankProgram, model: dict, optim: dict) -> None:
    """Stacked experts' entries of the DCP dicts (in place) -> one plain tensor per expert this rank holds, under
    its own name (a view of its row); DCP saves each once (from one of the ranks holding it)."""
    for f, (lo, hi) in expert_rows(program).items():
        members = program.stacked[f]
        local = _local(model.pop(f))
        model.update({members[e]: local[e - lo] for e in range(lo, hi)})
        entry = optim.pop(f, None)
        if entry is not None:
            for e in range(lo, hi):
                optim[members[e]] = {k: (_local(v)[e - lo] if isinstance(v, torch.Tensor) and v.dim() else v)
                                     for k, v in entry.items()}


def _state_names(program: RankProgram, state: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """State names in the same order on every rank (DCP's planning and DTensor ops are collective; a rank's
    state dict comes in its state.safetensors order, which can differ between ranks)."""
    names = state if state is not None else program.state
    return list(program.input_fqns) + sorted(set(names) - set(program.input_fqns))


def _param_names(program: RankProgram, state: Mapping[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str]]:
    """(parameter tensor, state name) of every parameter of ``optimizer``, found by identity in ``state``.

    Raises:
        CheckpointError: the optimizer holds a tensor that is not one of ``state``'s.
    """
    by_id = {id(t): f for f, t in state.items()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            f = by_id.get(id(p))
            if f is None:
                raise CheckpointError(f"the optimizer holds a parameter of shape {list(p.shape)} that is none of "
                                      "the program's state tensors; build the optimizer over the state tensors "
                                      "themselves (StepRunner.params)")
            out.append((p, f))
    return out


def _global_dicts(program: RankProgram, state: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                  device_mesh) -> tuple[dict, dict]:
    """{"model"}, {"optim"} parts of the DCP state dict: this rank's tensors as global DTensors sharing their
    memory (replicated ones as they are; 0-dim optimizer values such as AdamW's step are replicated).
    Collective (building the lowering-order mesh)."""
    ordered = ordered_device_mesh(device_mesh, program)
    model = {f: as_global(state[f].detach(), f, program, device_mesh, ordered) for f in _state_names(program, state)}
    optim: dict[str, dict[str, Any]] = {}
    for p, f in _param_names(program, state, optimizer):
        st = optimizer.state.get(p)
        if not st:
            continue
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():
                if v.shape != p.shape:
                    raise CheckpointError(f"optimizer state {k!r} of {f!r} has shape {list(v.shape)}, its parameter "
                                          f"{list(p.shape)}: only per-element or scalar state can be resharded")
                v = as_global(v.detach(), f, program, device_mesh, ordered)
            entry[k] = v
        optim[f] = entry
    _by_expert(program, model, optim)
    return model, optim


def _rng_states() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def _write_rng(directory: Path, rank: int) -> None:
    from safetensors.torch import save_file

    d = directory / RNG_DIR
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in _rng_states().items()}, str(d / f"rank{rank}.safetensors"))


class SaveFuture:
    """An asynchronous :func:`save_train_state` in flight: :meth:`result` waits for this rank's files to be
    written (then a barrier, then rank 0 may commit the directory). ``staged_s``: seconds the caller was
    blocked (planning, staging to CPU)."""

    def __init__(self, future, directory: Path, staged_s: float):
        self._future = future
        self.directory = directory
        self.staged_s = staged_s

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s`` seconds; None: no limit) until this rank's DCP files are written.

        Raises:
            CheckpointError: the write failed or did not finish in time; names the directory.
        """
        try:
            self._future.result(timeout=timeout_s)
        except TimeoutError:
            raise CheckpointError(f"writing checkpoint {str(self.directory)!r} did not finish within {timeout_s} s"
                                  ) from None
        except Exception as e:  # noqa: BLE001 - any failure of the writer thread
            raise CheckpointError(f"writing checkpoint {str(self.directory)!r} failed: {type(e).__name__}: {e}"
                                  ) from e


def checkpoint_process_group():
    """A new gloo process group over all ranks, for asynchronous saves: DCP's writer thread then runs its
    collectives on a group of its own, never interleaved with the training step's on the same group (which
    would hang or mix up ranks). Collective: call it on every rank, once, and pass it to every
    ``save_train_state(..., async_=True, process_group=...)``."""
    return dist.new_group(backend="gloo")


def save_train_state(directory: str | Path, program: RankProgram, state: Mapping[str, torch.Tensor],
                     optimizer: torch.optim.Optimizer, device_mesh, rank: int, *, async_: bool = False,
                     process_group=None) -> SaveFuture | None:
    """Write this rank's part of the training state into checkpoint directory ``directory`` (the temporary one
    of :func:`~adaptdist.runtime.checkpoint_store.prepare`). Collective: every rank calls it.

    ``directory/dcp``: a torch.distributed.checkpoint of ``{"model": every state tensor, "optim": the
    optimizer's per-parameter state keyed by parameter name}`` as global DTensors (each shard once);
    ``directory/rng/rank{rank}.safetensors``: this rank's torch RNG state.

    Args:
        state: state name -> this rank's tensor (shard or replica), e.g. ``StepRunner.state``.
        optimizer: a torch optimizer over tensors of ``state`` (``StepRunner.opt``).
        device_mesh: torch's DeviceMesh of the program's mesh (``register_mesh_groups``).
        async_: stage to CPU and plan now, write in a thread: returns a :class:`SaveFuture`; call its
            ``result()`` on every rank, then a barrier, before rank 0 commits the directory. The state may be
            changed (next steps) once this returns. Needs ``process_group`` from
            :func:`checkpoint_process_group` (one is created, collectively, when None).
        process_group: the group DCP coordinates on (None: the default group; see ``async_``).

    Returns:
        None (synchronous: every rank's files are written when it returns on any rank), or a SaveFuture.

    Raises:
        CheckpointError: the directory cannot be written, or the optimizer's state does not fit the program.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    model, optim = _global_dicts(program, state, optimizer, device_mesh)
    try:
        _write_rng(directory, rank)
        writer = dcp.FileSystemWriter(str(directory / DCP_DIR), sync_files=False)  # commit fsyncs every file
        if not async_:
            dcp.save({"model": model, "optim": optim}, storage_writer=writer, process_group=process_group)
            return None
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {str(directory)!r}: {e.strerror or e}") from None
    t0 = time.perf_counter()
    if process_group is None:
        process_group = checkpoint_process_group()
    fut = dcp.async_save({"model": model, "optim": optim}, storage_writer=writer, process_group=process_group)
    if not hasattr(fut, "result"):  # an AsyncSaveResponse (zero-overhead staging): wait on the upload
        fut = fut.upload_completion
    return SaveFuture(fut, directory, time.perf_counter() - t0)


def _read_meta(directory: Path) -> dict:
    p = directory / checkpoint_store.META_NAME
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(p)!r} cannot be read: {e}") from None


def _saved_entries(md) -> dict[str, dict[str, Any]]:
    """{parameter name: {state key: storage metadata}} of the checkpoint's "optim" part."""
    paths = md.planner_data or {}
    out: dict[str, dict[str, Any]] = {}
    for key, smd in md.state_dict_metadata.items():
        path = paths.get(key)
        if path is not None:
            if len(path) != 3 or path[0] != "optim":
                continue
            _, f, k = path
        else:  # no planner data: "optim.<fqn>.<key>", the key has no dot
            if not key.startswith("optim."):
                continue
            f, _, k = key[len("optim."):].rpartition(".")
        out.setdefault(str(f), {})[str(k)] = smd
    return out


def load_train_state(directory: str | Path, program: RankProgram, state: Mapping[str, torch.Tensor],
                     optimizer: torch.optim.Optimizer, device_mesh, rank: int, *, restore_rng: bool,
                     verify: bool = True, model: str | None = None, process_group=None) -> dict:
    """Load a checkpoint written by :func:`save_train_state` into this rank's ``state`` (in place: the
    tensors the program and the optimizer reference) and ``optimizer``, resharded into this program's
    placements whatever the saver's world size, mesh and placements were. Collective: every rank calls it.

    The optimizer may have no state yet: each parameter that has state in the checkpoint gets it (created from
    the checkpoint's metadata: shape of the parameter's shard or 0-dim, the saved dtype), and a parameter that
    has none there (it never had a gradient) gets none. Hyperparameters (lr, ...) stay the optimizer's own.

    Args:
        directory: the checkpoint directory (``step-XXXXXXXX``).
        restore_rng: set this rank's torch RNG from ``rng/rank{rank}.safetensors`` when that file exists
            (the saver had this rank); otherwise the RNG is left as it is.
        verify: check the manifest of checksums first (:func:`~adaptdist.runtime.checkpoint_store.verify`);
            pass False only when the caller just did (``latest_good``).
        model: the model's name, for the message refusing a checkpoint of another model.
        process_group: the group DCP coordinates on (None: the default group).

    Returns:
        The checkpoint's meta.json ({} when it has none).

    Raises:
        CheckpointError: the directory fails verification, was written for another model (names both and the
            first state that differs), lacks a state tensor, holds one of another global shape or dtype, or
            has optimizer state that does not fit its parameter; names the state, the shapes and the directory.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory)
    meta = checkpoint_store.verify(directory) if verify else _read_meta(directory)
    ours = state_shapes(program)
    if "state_shapes" in meta:
        checkpoint_store.check_same_model(meta, directory, model or "this run's", ours)
    dcp_dir = directory / DCP_DIR
    try:
        reader = dcp.FileSystemReader(str(dcp_dir))
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or unreadable .metadata, whatever torch raises
        raise CheckpointError(f"{str(dcp_dir)!r} is not a readable torch.distributed.checkpoint "
                              f"({type(e).__name__}: {e})") from None
    saved = md.state_dict_metadata
    rows = expert_rows(program)
    names = [n for f in _state_names(program, state)
             for n in ([program.stacked[f][e] for e in range(*rows[f])] if f in rows else [f])]
    held = {m: (f, e - rows[f][0]) for f in rows for e, m in enumerate(program.stacked[f]) if rows[f][0] <= e < rows[f][1]}
    local_of = {n: (state[held[n][0]][held[n][1]] if n in held else state[n]) for n in names}
    theirs_model = {k[len("model."):] for k in saved if k.startswith("model.")}
    if set(ours) != theirs_model:  # the whole model's names (a pipeline rank loads only its own: `names`)
        missing, extra = sorted(set(ours) - theirs_model), sorted(theirs_model - set(ours))
        raise CheckpointError(f"checkpoint {str(directory)!r} holds another model's state: it lacks {missing[:3]}"
                              f"{' and has ' + str(extra[:3]) + ' that this model does not' if extra else ''}; "
                              "resume with the model it was written for")
    for f in names:
        smd = saved[f"model.{f}"]
        if not isinstance(smd, TensorStorageMetadata) or list(smd.size) != ours[f]:
            size = list(smd.size) if isinstance(smd, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(f"checkpoint {str(directory)!r}: state {f!r} has global shape {size} there, "
                                  f"{ours[f]} here; resume with the model it was written for")
        if smd.properties.dtype != local_of[f].dtype:
            raise CheckpointError(f"checkpoint {str(directory)!r}: state {f!r} is {smd.properties.dtype} there, "
                                  f"{local_of[f].dtype} here")

    params = _param_names(program, state, optimizer)
    entries = _saved_entries(md)
    pnames = {f for _, f in params} | {m for f in rows for m in program.stacked[f]}
    # a pipeline rank's view (runtime/pipeline_programs.CheckpointView) names the parameters of every stage
    unknown = sorted(set(entries) - pnames - set(getattr(program, "all_param_fqns", ())))
    if unknown:
        raise CheckpointError(f"checkpoint {str(directory)!r} has optimizer state for {unknown[:3]}, which this "
                              "run does not train (another model, or other frozen parameters)")
    ordered = ordered_device_mesh(device_mesh, program)  # collective, every rank alike
    model_sd = {f: local_of[f].detach() if f in held else as_global(state[f].detach(), f, program, device_mesh, ordered)
                for f in names}
    optim_sd: dict[str, dict[str, Any]] = {}
    expert_state: dict[str, dict[str, torch.Tensor]] = {}  # stacked name -> its per-element state, whole rows
    for p, f in params:
        if f in rows:
            lo, hi = rows[f]
            members = program.stacked[f]
            first = members[lo] if hi > lo else members[0]
            if first not in entries:
                continue
            have = optimizer.state.get(p) or {}
            st: dict[str, Any] = {}
            for k, smd in sorted(entries[first].items()):
                if not isinstance(smd, TensorStorageMetadata) or list(smd.size) == []:
                    st[k] = smd  # a scalar: read from the first member this rank holds (or expert 0's)
                    continue
                old = have.get(k)
                ok = isinstance(old, torch.Tensor) and old.shape == p.shape and old.dtype == smd.properties.dtype
                st[k] = old.detach() if ok else torch.zeros(p.shape, dtype=smd.properties.dtype, device=p.device)
            expert_state[f] = st
            for e, m in enumerate(members):
                if not (lo <= e < hi) and m != first:
                    continue
                entry = {}
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        if lo <= e < hi:
                            entry[k] = v[e - lo]
                    elif m == first:
                        entry[k] = (have.get(k) if not isinstance(v, TensorStorageMetadata) else
                                    torch.zeros((), dtype=v.properties.dtype, device=p.device))
                optim_sd[m] = entry
            continue
        if f not in entries:
            continue
        have = optimizer.state.get(p) or {}
        entry = {}
        for k, smd in sorted(entries[f].items()):
            if not isinstance(smd, TensorStorageMetadata):
                entry[k] = have.get(k)  # a non-tensor value: DCP replaces it
                continue
            size, dtype = list(smd.size), smd.properties.dtype
            if size == []:
                local = torch.zeros((), dtype=dtype, device=p.device)
            elif size == ours[f]:
                local = torch.zeros(p.shape, dtype=dtype, device=p.device)
            else:
                raise CheckpointError(f"checkpoint {str(directory)!r}: optimizer state {k!r} of {f!r} has shape "
                                      f"{size}, its parameter {ours[f]}")
            old = have.get(k)
            if isinstance(old, torch.Tensor) and old.shape == local.shape and old.dtype == dtype:
                local = old.detach()
            entry[k] = local if local.dim() == 0 else as_global(local, f, program, device_mesh, ordered)
        optim_sd[f] = entry
    sd = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(sd, storage_reader=reader, process_group=process_group)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps rank failures in its own exception types
        raise CheckpointError(f"loading {str(dcp_dir)!r} failed: {type(e).__name__}: {e}") from None

    with torch.no_grad():
        for f in names:
            got = _local(sd["model"][f])
            if (got.untyped_storage().data_ptr() != local_of[f].untyped_storage().data_ptr() or got.numel() == 0
                    or f in held):
                local_of[f].copy_(got)
    for p, f in params:
        if f in rows:
            if f in expert_state:
                lo, hi = rows[f]
                first = program.stacked[f][lo] if hi > lo else program.stacked[f][0]
                loaded = sd["optim"][first]
                with torch.no_grad():  # DCP read each held expert's rows in place; copied again if it did not
                    for e in range(lo, hi):
                        for k, v in expert_state[f].items():
                            if isinstance(v, torch.Tensor) and k in sd["optim"][program.stacked[f][e]]:
                                v[e - lo].copy_(_local(sd["optim"][program.stacked[f][e]][k]))
                optimizer.state[p] = {k: (v if isinstance(v, torch.Tensor) else _local(loaded[k]))
                                      for k, v in expert_state[f].items()}
            else:
                optimizer.state.pop(p, None)
            continue
        if f in sd["optim"]:
            optimizer.state[p] = {k: _local(v) for k, v in sd["optim"][f].items()}
        else:
            optimizer.state.pop(p, None)
    if restore_rng:
        _restore_rng(directory, rank)
    return meta


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _restore_rng(directory: Path, rank: int) -> None:
    from safetensors.torch import load_file

    p = directory / RNG_DIR / f"rank{rank}.safetensors"
    if not p.is_file():
        return
    try:
        states = load_file(str(p))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{str(p)!r} is not an RNG state file ({type(e).__name__}: {e})") from None
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        for k, v in states.items():
            if k.startswith("cuda") and int(k[4:]) < torch.cuda.device_count():
                torch.cuda.set_rng_state(v, int(k[4:]))


def _digest(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous().reshape(-1)
        h = hashlib.sha256(f"{v.dtype}{list(v.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()[:32]
    return hashlib.sha256(repr(v).encode()).hexdigest()[:32]


def _replicated_axes(program: RankProgram, fqn: str) -> list[str]:
    """The mesh axes (of size > 1) over which state ``fqn`` is replicated (not sharded)."""
    texts = program.state_placements.get(fqn)
    return [a for i, a in enumerate(program.mesh) if program.mesh[a] > 1
            and (texts is None or not isinstance(parse_placement(texts[i]), Shard))]


def check_identical_replicas(program: RankProgram, state: Mapping[str, torch.Tensor],
                             optimizer: torch.optim.Optimizer | None, device_mesh) -> None:
    """Check that every state and optimizer-state tensor the plan replicates over a mesh axis is bitwise
    identical on that axis's ranks, and scalar optimizer state (AdamW's step) on every axis: e.g. after a
    resume (do not assume it). Collective: every rank calls it; one all_gather_object per mesh axis of size > 1
    of a 128-bit sha256 prefix per tensor.

    Raises:
        CheckpointError (on every rank alike): names the first states that differ and the ranks holding each
            distinct value.
    """
    digests: dict[str, dict[str, str]] = {a: {} for a in program.mesh if program.mesh[a] > 1}
    for f in _state_names(program, state):
        for a in _replicated_axes(program, f):
            digests[a][f"state {f!r}"] = _digest(state[f])
    if optimizer is not None:
        for p, f in _param_names(program, state, optimizer):
            for k, v in sorted((optimizer.state.get(p) or {}).items()):
                per_element = isinstance(v, torch.Tensor) and v.dim() > 0
                # a scalar (AdamW's step) is the same on every rank, whether its parameter is sharded or not
                for a in _replicated_axes(program, f) if per_element else list(digests):
                    digests[a][f"optimizer state {k!r} of {f!r}"] = _digest(v)
    bad = []
    for a, mine in digests.items():
        group = device_mesh.get_group(a)
        ranks = dist.get_process_group_ranks(group)
        gathered: list[Any] = [None] * len(ranks)
        dist.all_gather_object(gathered, mine, group=group)
        for name in sorted(set().union(*[set(g) for g in gathered])):
            values: dict[str, list[int]] = {}
            for r, g in zip(ranks, gathered):
                values.setdefault(g.get(name, "absent"), []).append(r)
            if len(values) > 1:
                bad.append(f"{name} differs across mesh axis {a!r}: ranks " +
                           " vs ".join(str(rs) for rs in sorted(values.values())))
    if bad:
        raise CheckpointError(f"replicas are not identical ({len(bad)} case(s)): " + "; ".join(bad[:4])
                              + ("; ..." if len(bad) > 4 else "") + "; a replicated tensor must be equal on every "
                              "rank that holds it: reload the checkpoint, or report a bug")
