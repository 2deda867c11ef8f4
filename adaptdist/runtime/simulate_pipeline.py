"""Run every rank's pipeline stage programs in one process, in GPipe order (numerics without processes).

No real send or receive: a stage's ``send`` tensors are handed to the next stage's ranks as their ``recv``
(checked against the specs), and gradients the other way. Collectives inside a stage (tensor parallelism)
are carried out by :func:`~adaptdist.runtime.simulate.simulate_ranks` over the ranks of that stage's
sub-mesh. The runtime's reductions (:mod:`adaptdist.stage_program`) are done here the same way the real
executor does them: the prologue's normalizers over the batch group, the microbatches' gradient
contributions added, then summed over each parameter's ``grad_groups``; the loss terms summed over the
microbatches and the batch group; with ``max_grad_norm``, the gradients clipped to the global norm (every distinct
shard counted once, :mod:`.grad_clip`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx

from ..errors import SimulationError
from ..mesh import Mesh
from ..stage_program import PipelineRankProgram, StageProgram, TensorSpec
from ..stage_routes import assemble, check_routes, cut, piece_shape
from .simulate import simulate_ranks


@dataclass
class PipelineSimulation:
    """What :func:`simulate_pipeline` computed.

    Attributes:
        loss: the step's global loss (0-dim tensor), as every loss rank computed it.
        grads: rank -> fqn -> the gradient of that rank's shard (after the runtime's all-reduces).
        params: rank -> fqn -> the parameter after one SGD step (``lr`` given; else the step-0 values).
        grad_norm: the global gradient norm before clipping (``max_grad_norm`` given; else None).
    """

    loss: torch.Tensor
    grads: dict[int, dict[str, torch.Tensor]]
    params: dict[int, dict[str, torch.Tensor]]
    grad_norm: float | None = None


def _check(vals: Sequence[torch.Tensor], specs: Sequence[TensorSpec], what: str) -> None:
    if len(vals) != len(specs):
        raise SimulationError(f"{what}: {len(vals)} tensors for {len(specs)} specs")
    for i, (v, sp) in enumerate(zip(vals, specs)):
        if tuple(v.shape) != tuple(sp.shape) or v.dtype != sp.dtype:
            raise SimulationError(f"{what}: tensor {i} is {tuple(v.shape)} {v.dtype}, its spec {tuple(sp.shape)} "
                                  f"{sp.dtype}")


def _routed(r: int, recv_routes, specs: Sequence[TensorSpec], out_of: dict, send_routes_of: dict,
            what: str) -> list[torch.Tensor]:
    """What rank ``r`` receives along ``recv_routes`` (one per tensor): each piece cut from its sender's tensor
    (``out_of[peer]``) by the sender's own route (``send_routes_of[peer]``) to ``r``, then assembled."""
    out = []
    for i, (route, spec) in enumerate(zip(recv_routes, specs)):
        parts = []
        for p in route.pieces:
            mine = [(peer, t) for peer, t in cut(out_of[p.peer][i], send_routes_of[p.peer][i]) if peer == r]
            if len(mine) != 1:
                raise SimulationError(f"{what}: rank {p.peer} sends {len(mine)} pieces of tensor {i} to rank {r}, "
                                      "its route 1")
            if tuple(mine[0][1].shape) != piece_shape(spec.shape, p):
                raise SimulationError(f"{what}: piece of tensor {i} from rank {p.peer} is {tuple(mine[0][1].shape)}, "
                                      f"the route wants {piece_shape(spec.shape, p)}")
            parts.append(mine[0][1])
        out.append(assemble(parts, route, spec.shape, spec.dtype))
    return out


def _run(mods: list, ins: list, mesh: Mesh | None) -> list:
    """Compiled programs through :func:`simulate_ranks`; loaded ones (plain modules, from
    :func:`~adaptdist.stage_program_io.load_pipeline_program`) called one by one: they must not hold collectives."""
    if all(isinstance(m, torch.fx.GraphModule) for m in mods):
        return simulate_ranks(mods, ins, mesh)
    return [m(*args) for m, args in zip(mods, ins)]


def simulate_pipeline(programs: Mapping[int, PipelineRankProgram], batch: tuple[torch.Tensor, ...],
                      lr: float | None = None, max_grad_norm: float | None = None) -> PipelineSimulation:
    """Run one step of ``programs`` (every rank's, from :func:`~adaptdist.compiler.lowering.lower` of a
    pipeline plan) on the global ``batch``: all microbatches' forwards stage by stage, then their backwards
    in reverse (GPipe). With ``lr``, each rank's parameters take one SGD step ``p - lr * grad``; with
    ``max_grad_norm``, after the gradients are clipped as ``torch.nn.utils.clip_grad_norm_`` clips the whole model's.

    Raises:
        SimulationError: a tensor that does not match its send/recv spec, loss ranks that disagree, or a
            collective mismatch inside a stage (see :func:`simulate_ranks`).
    """
    progs = dict(programs)
    for p in progs.values():
        check_routes(p)
    any_p = next(iter(progs.values()))
    S = any_p.stages[0].num_stages
    M = any_p.num_microbatches
    stage_of = {(r, st.stage): st for r, p in progs.items() for st in p.stages}
    stage_ranks = any_p.stage_ranks

    def submesh(s: int) -> Mesh | None:
        sub = stage_of[(stage_ranks[s][0], s)].submesh
        return Mesh(tuple(sub.items())) if sub else None

    # prologue: per replica, then reduced over the batch group
    norms: dict[int, list[torch.Tensor]] = {}
    for r, p in progs.items():
        norms[r] = list(p.prologue.module(*p.local_batch(batch))) if p.prologue is not None else []
    reduced = {}
    for r, p in progs.items():
        if p.prologue is None:
            reduced[r] = []
            continue
        out = []
        for k, op in enumerate(p.prologue.reduce_ops):
            vals = torch.stack([norms[m][k] for m in p.batch_group])
            out.append(vals.amax(0) if op == "max" else vals.amin(0) if op == "min" else vals.sum(0))
        reduced[r] = out

    sends: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # (rank, stage, mb) -> send
    saved: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    loss_terms: dict[int, list[torch.Tensor]] = {}
    for m in range(M):
        for s in range(S):
            ranks = stage_ranks[s]
            mods, ins = [], []
            for r in ranks:
                st, p = stage_of[(r, s)], progs[r]
                if st.routes is not None and st.recv_from is not None:
                    prev = {x: stage_of[(x, s - 1)] for x in stage_ranks[s - 1]}
                    recv = _routed(r, st.routes.recv, st.recv_specs, {x: sends[(x, s - 1, m)] for x in prev},
                                   {x: prev[x].routes.send for x in prev}, f"stage {s} microbatch {m} recv")
                else:
                    recv = sends[(st.recv_from, s - 1, m)] if st.recv_from is not None else []
                _check(recv, st.recv_specs, f"rank {r} stage {s} microbatch {m} recv")
                mods.append(st.forward)
                ins.append([p.state[f] for f in st.state_names] + list(recv) + list(p.microbatch(batch, m))
                           + reduced[r])
            outs = _run(mods, ins, submesh(s))
            for r, o in zip(ranks, outs):
                st = stage_of[(r, s)]
                o = list(o)
                if st.is_last:
                    loss_terms.setdefault(r, []).append(o.pop(0))
                send, rest = o[:len(st.send_specs)], o[len(st.send_specs):]
                _check(send, st.send_specs, f"rank {r} stage {s} microbatch {m} send")
                if len(rest) != st.num_saved:
                    raise SimulationError(f"rank {r} stage {s}: forward returned {len(rest)} saved values, "
                                          f"num_saved is {st.num_saved}")
                sends[(r, s, m)] = [t.contiguous() for t in send]
                saved[(r, s, m)] = rest
    grads: dict[int, dict[str, torch.Tensor]] = {r: {} for r in progs}
    gsend: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    for m in range(M):
        for s in reversed(range(S)):
            ranks = stage_ranks[s]
            mods, ins = [], []
            for r in ranks:
                st = stage_of[(r, s)]
                if st.routes is not None and st.send_to is not None:
                    nxt = {x: stage_of[(x, s + 1)] for x in stage_ranks[s + 1]}
                    gin = _routed(r, st.routes.grad_in, st.grad_in_specs, {x: gsend[(x, s + 1, m)] for x in nxt},
                                  {x: nxt[x].routes.grad_out for x in nxt}, f"stage {s} microbatch {m} grad_in")
                else:
                    gin = gsend[(st.send_to, s + 1, m)] if st.send_to is not None else []
                _check(gin, st.grad_in_specs, f"rank {r} stage {s} microbatch {m} grad_in")
                mods.append(st.backward_input)
                ins.append(saved.pop((r, s, m)) + list(gin))
            outs = _run(mods, ins, submesh(s))
            mods, ins = [], []
            for r, o in zip(ranks, outs):
                st = stage_of[(r, s)]
                o = list(o)
                gout, sw = o[:len(st.grad_out_specs)], o[len(st.grad_out_specs):]
                _check(gout, st.grad_out_specs, f"rank {r} stage {s} microbatch {m} grad_out")
                gsend[(r, s, m)] = [t.contiguous() for t in gout]
                mods.append(st.backward_weight)
                ins.append(sw)
            outs = _run(mods, ins, submesh(s))
            for r, o in zip(ranks, outs):
                st = stage_of[(r, s)]
                for f, g in zip(st.grad_fqns, o):
                    grads[r][f] = grads[r][f] + g if f in grads[r] else g
    # the runtime's all-reduces: gradients over their groups, the loss over the batch group
    final: dict[int, dict[str, torch.Tensor]] = {}
    for r, p in progs.items():
        final[r] = {}
        for f in grads[r]:
            group = p.grad_groups.get(f, (r,))
            final[r][f] = torch.stack([grads[x][f] for x in group]).sum(0)
    norm = None
    if max_grad_norm is not None:  # as the executor: each distinct shard's squares once, one sum, one scale
        from .grad_clip import owned_squares, scale_grads_, shard_owners
        from .pipeline_programs import _box

        owners = shard_owners({r: [(f, _box(p, f, tuple(p.global_shapes.get(f, tuple(p.state[f].shape)))))
                                   for f in p.param_fqns] for r, p in progs.items()})
        norm = float(sum(owned_squares(final[r], owners[r]) for r in progs).sqrt())
        for r in progs:
            scale_grads_(final[r].values(), norm, max_grad_norm)
    losses = {}
    for r, p in progs.items():
        if p.loss_rank:
            losses[r] = torch.stack([t for x in p.batch_group for t in loss_terms[x]]).sum()
    first = next(iter(losses.values()))
    for r, v in losses.items():
        if not torch.allclose(v, first, rtol=1e-5, atol=1e-6):
            raise SimulationError(f"loss ranks disagree: rank {r} has {v.item()}, rank {next(iter(losses))} "
                                  f"{first.item()}")
    params = {}
    for r, p in progs.items():
        params[r] = {f: (t - lr * final[r][f] if lr is not None and f in final[r] else t)
                     for f, t in p.state.items() if f in p.param_fqns}
    return PipelineSimulation(first, final, params, norm)
