"""Checkpoints for users of the torch.compile backend: ``adaptdist.save_checkpoint`` / ``adaptdist.load_checkpoint``.

A user's own training script (``torch.compile(model, backend="adaptdist")``, run by ``torchrun``) saves and
resumes with two calls that work under any plan (dp, fsdp, tp, auto) and any world size: save on 2 ranks,
load on 3 or on 1, into a compiled model (before or after its first call) or an uncompiled one::

    resumed = adaptdist.load_checkpoint("ckpt", model, opt)      # None: no checkpoint under ckpt/ yet
    start = resumed[0] if resumed else 0
    for step in range(start, steps):
        ... one step on the batch of `step` ...
        if (step + 1) % every == 0:
            adaptdist.save_checkpoint("ckpt", model, opt, step=step + 1, extra={"seen": ...}, keep=3)

On disk (``path`` is the checkpoint root; :mod:`adaptdist.runtime.checkpoint_store` makes each directory
atomic and checks it by a manifest of sha256 checksums before anything in it is loaded)::

    path/step-00000100/
      .metadata, __R_0.distcp    torch.distributed.checkpoint (DCP) of the state below
      rng/rank00000.safetensors  each rank's torch RNG state ("cpu", and "cuda:I" per CUDA device)
      meta.json                  step, extra, model class, global shapes, the optimizer's class, param groups
      manifest.json              the checksums (written last)

The DCP state is a flat dict: ``model/<name>`` for every entry of the model's ``state_dict()`` (names of the
module given to ``torch.compile``, without ``_orig_mod.``) and ``optim/<parameter name>/<key>`` for each
tensor of the optimizer's per-parameter state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's
``momentum_buffer``). A parameter the backend sharded (and each state tensor shaped like its shard) is saved
as a global DTensor: the shard this rank holds, over a DeviceMesh of the parameter's plan with its dims in
lowering order (the order adaptdist chunks a dim sharded on several axes, see :mod:`.checkpoint`), with the
global shape and stride given, so uneven torch.chunk shards and empty shards are described exactly.
Everything else is a plain tensor (replicated: DCP writes it once). DCP reshards on load: a target that is a
shard of another layout reads only its own box, a full tensor reads the whole.

Loading creates the optimizer's state when it has none yet (built, no step taken) from the checkpoint's
metadata; a parameter with no state in the checkpoint gets none. Loaded into a compiled model before its
first call (its parameters are full then), the optimizer's state is full too; a step pre-hook on the
optimizer keeps, at each ``step()``, only this rank's shard of the state of every parameter the backend has
since sharded.

Every rank must call both functions (they are collectives: DCP's plans and barriers), on a
file system that all ranks share (one host, or a shared mount). The checkpoint's ``.metadata`` is a pickle:
load only checkpoints from a source you trust (the checksums catch corruption and mix-ups, not an author).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import AdaptdistError, CheckpointError, InternalError
from . import checkpoint_store as store
from .sharded_params import ShardedStateWarning, layout_of

log = logging.getLogger(__name__)

FORMAT = "adaptdist.backend_checkpoint/1"
_RNG_DIR = "rng"
_OPT_HOOKED = "_adaptdist_reshard_state_hook"


# --- helpers ---------------------------------------------------------------------------------------------

def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank (a collective)."""
    if not _dist_on():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t)
    return bool(t.item())


def _broadcast_int(value: int) -> int:
    if not _dist_on():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def _inner(model: nn.Module) -> nn.Module:
    """The module given to torch.compile (its names carry no ``_orig_mod.`` prefix)."""
    return getattr(model, "_orig_mod", model)


def _model_state(inner: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict entries as the tensors themselves (parameters as Parameters: a sharded one
    holds its shard and layout)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardedStateWarning)
        return dict(inner.state_dict(keep_vars=True))


def _global_shape(t: torch.Tensor) -> list[int]:
    layout = layout_of(t)
    return list(layout.global_shape) if layout is not None else list(t.shape)


def _param_names(inner: nn.Module) -> dict[int, str]:
    """id(parameter) -> its (first) name in the model."""
    return {id(p): n for n, p in inner.named_parameters()}


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


# --- a shard as a global DTensor ---------------------------------------------------------------------------

def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of piece ``i`` of ``n`` elements split as torch.chunk / DTensor's Shard does."""
    size = -(-n // parts) if n else 0
    lo = min(i * size, n)
    return lo, min(lo + size, n)


class _Meshes:
    """The DeviceMeshes of the layouts met in one save or load (one per plan), made on first use. They create
    no process groups (DCP communicates over the default group): nothing is left behind per checkpoint."""

    def __init__(self) -> None:
        self._by_plan: dict[str, tuple[Any, list[str], dict[str, int]]] = {}

    def get(self, layout: Any, device_type: str) -> tuple[Any, list[str], dict[str, int]]:
        """(DeviceMesh with dims in lowering order, that order, axis -> size) of ``layout``'s plan."""
        key = layout.plan_json
        if key not in self._by_plan:
            from .. import _torch_compat as compat
            from ..mesh import Mesh, lowering_order
            from ..plan import Plan

            plan = Plan.from_json(layout.plan_json, f"the plan that sharded {layout.fqn}")
            mesh = Mesh(tuple(plan.mesh.items()))
            order = lowering_order(mesh, plan.batch_axis)
            ranks = torch.arange(mesh.world_size).reshape(mesh.sizes).permute([mesh.names.index(a) for a in order])
            device_mesh = compat.device_mesh_without_groups(device_type, ranks, tuple(order))
            self._by_plan[key] = (device_mesh, order, mesh.as_dict())
        return self._by_plan[key]


def _as_global(local: torch.Tensor, layout: Any, meshes: _Meshes) -> torch.Tensor:
    """``local`` (this rank's shard of a tensor laid out as ``layout``) as a global DTensor.

    Raises:
        AdaptdistError: the layout is of another world size than the process group's.
        InternalError: the layout's ranges are not the torch.chunk boxes DTensor computes for its placements.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ..mesh import Mesh
    from ..placement import Shard as AShard, parse_placement

    rank, world = _rank_world()
    if world != len(layout.ranges):
        raise AdaptdistError(f"parameter {layout.fqn} was sharded over {len(layout.ranges)} ranks but the process "
                             f"group has {world}: save the checkpoint on every rank of the job that compiled it")
    if getattr(layout, "whole_or_none", False):  # a ModuleList expert this rank holds whole: a plain tensor
        return local
    device_mesh, order, sizes = meshes.get(layout, local.device.type)
    placements = {a: parse_placement(layout.placements[a]) for a in order}
    # every rank's box by DTensor's rule (torch.chunk, mesh dims left to right), checked against the layout's
    # on every rank alike (a mismatch raises everywhere, before any collective of DCP)
    mesh = Mesh(tuple(sizes.items()))
    for r in range(world):
        coords = dict(zip(sizes, mesh.coords(r)))
        for d, n in enumerate(layout.global_shape):
            lo, hi = 0, n
            for a in order:
                p = placements[a]
                if isinstance(p, AShard) and p.dim == d and sizes[a] > 1:
                    s, e = _chunk(hi - lo, sizes[a], coords[a])
                    lo, hi = lo + s, lo + e
            have_lo, have_hi = layout.ranges[r][d]
            if have_hi - have_lo != hi - lo or (hi > lo and have_lo != lo):
                raise InternalError(f"{layout.fqn}: rank {r} holds {layout.ranges[r]} of {list(layout.global_shape)}, "
                                    f"but DTensor places dim {d} at [{lo}, {hi}) for {layout.placements} over {order}")
    shape = torch.Size(layout.global_shape)
    stride = torch.empty(shape, device="meta").stride()
    dplacements = [Shard(placements[a].dim) if isinstance(placements[a], AShard) else Replicate() for a in order]
    return DTensor.from_local(local, device_mesh, dplacements, run_check=False, shape=shape, stride=stride)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# --- save --------------------------------------------------------------------------------------------------

def _optimizer_entries(inner: nn.Module, optimizer: torch.optim.Optimizer | None
                       ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]], list[dict], dict]:
    """(parameter name -> {key: state tensor}, name -> {key: JSON-able non-tensor state}, param groups
    (hyperparameters with ``params`` as names), name -> parameter), for the parameters the optimizer holds.

    Raises:
        CheckpointError: the optimizer holds a parameter that is not the model's.
    """
    if optimizer is None:
        return {}, {}, [], {}
    names = _param_names(inner)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups, params = [], {}
    for gi, group in enumerate(optimizer.param_groups):
        gnames = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"the optimizer's param group {gi} holds a parameter of shape {list(p.shape)} "
                                      f"that is not in {type(inner).__name__}.named_parameters(); pass the model "
                                      "whose parameters the optimizer was built from")
            name = names[id(p)]
            gnames.append(name)
            params[name] = p
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors.setdefault(name, {})[k] = v
                elif _jsonable(v):
                    scalars.setdefault(name, {})[k] = v
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                 if k != "params" and _jsonable(v)}
        groups.append({**hyper, "params": gnames})
    return tensors, scalars, groups, params


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, extra: Mapping[str, Any] | None = None, keep: int | None = None) -> Path:
    """Write the checkpoint of ``step`` under the root ``path`` (``path/step-XXXXXXXX``): the model's state,
    the optimizer's per-parameter state and hyperparameters, each rank's RNG state, ``step`` and ``extra``
    (module docstring). A collective: every rank calls it with the same arguments. Atomic: the directory
    appears complete, under its final name, or not at all; a checkpoint of the same step is replaced.

    Args:
        path: the checkpoint root (a directory; made if missing), on a file system all ranks share.
        model: the ``torch.compile``'d model (or the module itself, compiled or not).
        optimizer: the optimizer over ``model.parameters()`` (None: the model only).
        step: the number of steps done (an integer >= 0); ``load_checkpoint`` returns it.
        extra: a JSON-able dict stored in ``meta.json`` (a data position, an LR scheduler's state_dict, ...:
            what the model and optimizer do not hold).
        keep: keep only the newest ``keep`` checkpoints under ``path`` (None: all).

    Returns:
        The checkpoint's directory (on every rank).

    Raises:
        CheckpointError: ``step`` or ``extra`` is invalid, the optimizer holds a parameter not in the model,
            or a write failed (on any rank: then every rank raises, and no checkpoint is committed).
        AdaptdistError: a sharded parameter's layout is of another world size than the process group's.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"save_checkpoint needs an integer step >= 0, got {step!r}")
    extra = dict(extra or {})
    if not _jsonable(extra):
        raise CheckpointError("save_checkpoint's extra must be a JSON-able dict (str keys; numbers, strings, lists, "
                              f"dicts): {sorted(extra)} has a value json.dumps refuses")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
    root = Path(path)
    rank, world = _rank_world()
    inner = _inner(model)
    meshes = _Meshes()

    state: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, t in _model_state(inner).items():
        layout = layout_of(t)
        shapes[name] = _global_shape(t)
        if _elsewhere(layout, rank):
            continue  # an expert another rank holds whole: saved by that rank, under its own name
        state[f"model/{name}"] = t.detach() if layout is None else _as_global(t.detach(), layout, meshes)
    opt_tensors, opt_scalars, groups, params = _optimizer_entries(inner, optimizer)
    opt_meta: dict[str, dict[str, Any]] = {}
    for pname, entries in opt_tensors.items():
        p = params[pname]
        layout = layout_of(p)
        for k, v in entries.items():
            like = tuple(v.shape) == tuple(p.shape) and (layout is not None or v.dim() > 0)
            if not (like and _elsewhere(layout, rank)):
                state[f"optim/{pname}/{k}"] = (_as_global(v.detach(), layout, meshes) if like and layout is not None
                                               else v.detach())
            opt_meta.setdefault(pname, {})[k] = {
                "shape": _global_shape(p) if like else list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                "like_param": like, "device_type": v.device.type}
    meta = {"format": FORMAT, "step": step, "extra": extra, "model": type(inner).__name__, "world_size": world,
            "state_shapes": shapes,
            "optimizer": None if optimizer is None else {
                "type": type(optimizer).__name__, "param_groups": groups, "state": opt_meta, "scalars": opt_scalars}}

    failed: Exception | None = None
    if rank == 0:
        try:
            store.prepare(root, step)
        except CheckpointError as e:
            failed = e
    if _any_rank(failed is not None):
        raise failed or CheckpointError(f"rank 0 could not create the checkpoint of step {step} under {str(root)!r}")
    tmp = store.temporary_dir(root, step)  # what prepare made on rank 0 (the file system is shared)
    try:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda:{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        (tmp / _RNG_DIR).mkdir(exist_ok=True)
        save_file(rng, str(tmp / _RNG_DIR / f"rank{rank:05d}.safetensors"))
    except Exception as e:  # on this rank only: every rank must learn of it, or the others would wait in DCP
        failed = CheckpointError(f"rank {rank} could not write its RNG state into {str(tmp)!r}: "
                                 f"{getattr(e, 'strerror', None) or e}")
    if _any_rank(failed is not None):
        raise failed or CheckpointError(f"another rank could not write its part of the checkpoint of step {step} "
                                        f"into {str(tmp)!r} (its error names it); nothing was committed")
    try:
        with warnings.catch_warnings():  # one process, no process group: DCP says it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not _dist_on())
    except Exception as e:  # DCP gathers every rank's failure and raises on all of them
        raise CheckpointError(f"writing the checkpoint of step {step} into {str(tmp)!r} failed: "
                              f"{type(e).__name__}: {e}") from e
    _barrier()
    final = store.step_dir(root, step)
    if rank == 0:
        try:
            final = store.commit(tmp, meta, keep=keep)
        except CheckpointError as e:
            failed = e
    if _any_rank(failed is not None):  # also the barrier that keeps every rank from reading before the commit
        raise failed or CheckpointError(f"rank 0 could not commit the checkpoint of step {step} under {str(root)!r}")
    if rank == 0:
        log.info("adaptdist: checkpoint of step %d written to %s", step, final)
    return final


# --- load --------------------------------------------------------------------------------------------------

_NO_CHECKPOINT, _NONE_GOOD = -1, -2


def _choose(root: Path, log_fn: Callable[[str], None]) -> tuple[Path, dict]:
    """Rank 0 picks the newest good checkpoint (naming the skipped ones), every rank learns which. Returns
    (its directory, meta); raises LookupError when ``root`` holds no checkpoint at all."""
    rank, _ = _rank_world()
    chosen = _NO_CHECKPOINT
    meta = None
    if rank == 0:
        info = store.latest_good(root, log=log_fn)
        if info is not None:
            chosen, meta = info.step, info.meta
        elif store.list_checkpoints(root):
            chosen = _NONE_GOOD
    chosen = _broadcast_int(chosen)
    if chosen == _NO_CHECKPOINT:
        raise LookupError(root)
    if chosen == _NONE_GOOD:
        raise CheckpointError(f"no checkpoint under {str(root)!r} is usable (each is partial or corrupt: the log "
                              "names why); move them away to start afresh, or restore a good copy")
    where = store.step_dir(root, chosen)
    if meta is None:
        try:
            meta = json.loads((where / store.META_NAME).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"rank {rank} cannot read {str(where / store.META_NAME)!r} ({e}), which rank 0 "
                                  "verified: do all ranks share this file system?") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{str(where)!r} is not a checkpoint of adaptdist.save_checkpoint (format "
                              f"{meta.get('format')!r}, this adaptdist reads {FORMAT!r}); adaptdist train's "
                              "checkpoints resume with adaptdist train --resume")
    return where, meta


def _reshard_state_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before ``optimizer.step()``: a parameter the backend sharded since its full state was loaded keeps this
    rank's shard of that state only."""
    rank, _ = _rank_world()
    for p, st in optimizer.state.items():
        layout = layout_of(p)
        if layout is None or tuple(p.shape) == tuple(layout.global_shape):
            continue
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(layout.global_shape):
                st[k] = layout.local(v, rank)


def _target(like: torch.Tensor, layout: Any, meshes: _Meshes) -> torch.Tensor:
    return like if layout is None else _as_global(like, layout, meshes)


def _elsewhere(layout: Any, rank: int) -> bool:
    """Whether ``layout`` is a ModuleList expert's (each rank holds it whole or not at all) and this rank does not
    hold it."""
    return layout is not None and getattr(layout, "whole_or_none", False) and not layout.held_whole(rank)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    log_fn: Callable[[str], None] | None = None) -> tuple[int, dict] | None:
    """Load the newest good checkpoint under the root ``path`` into ``model`` (and ``optimizer``), whatever the
    plan and world size it was saved under and whatever the model is now: uncompiled (full parameters), or
    compiled, before its first call (full) or after (shards of any layout: each rank reads its own box).
    Newer checkpoints that are partial or corrupt are skipped, each named with why through ``log_fn``
    (default: this module's logger, WARNING). Restores the model's state, the optimizer's per-parameter state
    (created if the optimizer has none yet; a parameter without state in the checkpoint gets none) and its
    param groups' hyperparameters (``lr``, ...), and this rank's RNG state (when the checkpoint has one for
    this rank). A collective: every rank calls it.

    Returns:
        ``(step, extra)`` as given to :func:`save_checkpoint`; None when ``path`` holds no checkpoint at all
        (a fresh start).

    Raises:
        CheckpointError: checkpoints exist but none is usable; the checkpoint was written for another model
            (names both and the first state that differs) or another optimizer class, or its param groups
            hold other parameters than the optimizer's.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(path)
    rank, _ = _rank_world()
    log_fn = log_fn or log.warning
    try:
        where, meta = _choose(root, log_fn)
    except LookupError:
        return None
    inner = _inner(model)
    own = _model_state(inner)
    store.check_same_model(meta, where, type(inner).__name__, {n: _global_shape(t) for n, t in own.items()})
    meshes = _Meshes()
    targets: dict[str, torch.Tensor] = {}
    dest: dict[str, torch.Tensor] = {}
    for name, t in own.items():
        if _elsewhere(layout_of(t), rank):
            continue  # an expert another rank holds: this rank reads nothing of it
        local = t.detach()
        dest[f"model/{name}"] = local
        targets[f"model/{name}"] = _target(local, layout_of(t), meshes)

    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    ometa = meta.get("optimizer")
    if optimizer is not None:
        if ometa is None:
            raise CheckpointError(f"checkpoint {str(where)!r} holds no optimizer state; load it with optimizer=None")
        if ometa["type"] != type(optimizer).__name__:
            raise CheckpointError(f"checkpoint {str(where)!r} holds the state of a {ometa['type']} optimizer, not of "
                                  f"this {type(optimizer).__name__}: build the optimizer it was written with")
        _, _, groups, params = _optimizer_entries(inner, optimizer)
        theirs = [g["params"] for g in ometa["param_groups"]]
        ours = [g["params"] for g in groups]
        if theirs != ours:
            raise CheckpointError(f"checkpoint {str(where)!r}'s optimizer has param groups of "
                                  f"{[len(g) for g in theirs]} parameters, this one {[len(g) for g in ours]} "
                                  f"(or other names: first {theirs[0][:1] if theirs else []} vs "
                                  f"{ours[0][:1] if ours else []}); build it over the same parameters")
        for pname, entries in ometa["state"].items():
            p = params[pname]
            layout = layout_of(p)
            old = optimizer.state.get(p, {})
            st: dict[str, Any] = {}
            for k, info in entries.items():
                dtype = getattr(torch, info["dtype"])
                cur = old.get(k)
                if info["like_param"]:
                    want_shape = tuple(p.shape)
                    device = p.device
                else:
                    want_shape = tuple(info["shape"])
                    device = p.device if info.get("device_type", "cpu") != "cpu" else torch.device("cpu")
                if not (isinstance(cur, torch.Tensor) and tuple(cur.shape) == want_shape and cur.dtype == dtype):
                    cur = torch.zeros(want_shape, dtype=dtype, device=device)
                cur = cur.detach()
                key = f"optim/{pname}/{k}"
                st[k] = cur
                if info["like_param"] and _elsewhere(layout, rank):
                    continue
                dest[key] = cur
                targets[key] = _target(cur, layout, meshes) if info["like_param"] else cur
            st.update(ometa.get("scalars", {}).get(pname, {}))
            new_state[p] = st

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(targets, checkpoint_id=str(where), no_dist=not _dist_on())
    with torch.no_grad():
        for key, t in targets.items():
            local = _to_local(t)
            if local.data_ptr() != dest[key].data_ptr() or local.shape != dest[key].shape:
                dest[key].copy_(local)

    if optimizer is not None:
        optimizer.state.clear()
        for p, st in new_state.items():
            optimizer.state[p] = st
        for group, saved in zip(optimizer.param_groups, ometa["param_groups"]):
            for k, v in saved.items():
                if k == "params" or k not in group:
                    continue
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        if not getattr(optimizer, _OPT_HOOKED, False):
            optimizer.register_step_pre_hook(_reshard_state_pre_hook)
            setattr(optimizer, _OPT_HOOKED, True)

    rng_file = where / _RNG_DIR / f"rank{rank:05d}.safetensors"
    if rng_file.is_file():
        from safetensors.torch import load_file

        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                if f"cuda:{i}" in rng:
                    torch.cuda.set_rng_state(rng[f"cuda:{i}"], i)
    else:
        log.info("adaptdist: checkpoint %s has no RNG state of rank %d (written by %s ranks); this rank keeps its "
                 "own", where, rank, meta.get("world_size"))
    _barrier()
    if rank == 0:
        log.info("adaptdist: resumed from %s (step %d, written by %s ranks)", where, meta["step"],
                 meta.get("world_size"))
    return int(meta["step"]), dict(meta.get("extra") or {})
