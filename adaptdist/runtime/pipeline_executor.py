"""Run one rank's pipeline step: its schedule's action list over torch.distributed point-to-point ops.

A :class:`~adaptdist.stage_program.PipelineRankProgram` holds this rank's stage programs (one; several for
interleaved 1F1B) and the step's layout (module docstring of :mod:`adaptdist.stage_program`). One step:

1. the prologue (if any) on this replica's whole local batch; its outputs all-reduced over ``batch_group`` with
   their ``reduce_ops``: the normalizers every ``forward`` takes;
2. the schedule (:func:`adaptdist.pipeline_schedules.pipeline_order`, this rank's list): ``F`` runs a stage's
   forward on one microbatch and keeps its ``saved`` values; ``B`` runs ``backward_input`` then
   ``backward_weight``; zero bubble runs them apart as ``I`` and ``W``; each microbatch's gradient contributions are
   added up per parameter; ``SEND_*`` / ``RECV_*`` move activations and gradients between stages, each message
   received into a buffer allocated from the program's specs before it arrives;
3. the accumulated gradients all-reduced (sum) over each parameter's ``grad_groups`` entry (data-parallel peers of
   the stage, and for a tied weight the ranks of the other stages holding it), one flat all-reduce per group, the
   groups in one global order so that no two ranks wait on each other in different groups;
4. the loss: the last stage's microbatch terms summed, all-reduced over its ``batch_group`` and handed to every
   rank (one world all-reduce of a scalar, only the lowest loss rank contributing), so rank 0 reports it.

Where adjacent stages run on sub-meshes of different data-parallel sizes, each send or receive action moves every
tensor's pieces to or from several peers (:attr:`StageProgram.routes`, :mod:`adaptdist.stage_routes`: why that
stays deadlock-free).

Sends and receives are posted, not run to completion, at their place in the list: ``SEND_*`` posts ``isend`` and
moves on (the works, holding their tensors, are waited for at the step's end); ``RECV_*`` posts ``irecv`` into
buffers allocated from the program's specs, and the rank waits for them only right before the compute action that
uses them (outside its span: the wait is idle time in the trace, a ``wait`` span). torch.distributed.pipelining runs
its lists the same way (batched ``isend``/``irecv``, receives waited before use, sends at the step's end). Why not
blocking: gloo's send completes only once the peer has posted the matching receive (a rendezvous, even for 64
bytes), and torch's ``_add_send_recv`` places a receive at its point of one global order, often several actions
before its use (1F1B's last rank receives ``F(i+1)``'s activations before ``B(i)``; interleaved and zero bubble
receive before an independent ``F``), so blocking sends and receives made each rank wait for its peer's whole
compute action: on WideMLP (benchmarks/RESULTS.md, "bench_pp_bubble: posted sends and receives") the idle fraction
was 1.5-8x the formula's, and posting brought 1F1B's down to it. Still deadlock-free: the lists are proven to
terminate under blocking (rendezvous) semantics (:func:`adaptdist.pipeline_schedules.check_deadlock_free`), and
every wait here needs less than the blocking one at the same point of the list (a receive: the peer has posted the
send, which it had done before the rendezvous; a send, at the step's end: the peer has posted the receive, which it
had done before finishing its list), so every point the blocking run reaches this one reaches too: the lists
terminate, for any schedule and any routes. Every message has its own tag (stage,
direction, microbatch, tensor), so a misordered pair fails instead of mixing up tensors. A peer that dies or stalls
fails the wait: :class:`~adaptdist.errors.CollectiveTimeoutError` names the peer rank, the action and the
microbatch. A sent tensor stays referenced until the step's end (at most one boundary activation or gradient per
microbatch and stage: GPipe's footprint at the boundary, small beside the stage's saved activations).

Process groups (``torch.distributed.new_group`` is collective over all ranks): :func:`setup_pipeline_groups` gathers
every rank's group memberships once and creates each distinct group on every rank, in sorted order, then the
shared-memory groups of :attr:`~adaptdist.stage_program.PipelineRankProgram.shm_groups` (``--comm auto|shm``: groups
whose ranks share a host) over them. The all-reduces of step 1, 3 and 4 over such a rank set run on adaptdist's
kernels for float32, bfloat16 and float16 sums and maxima (:meth:`PipelineStepRunner._all_reduce`); sends and
receives, and other dtypes, stay on gloo.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from ..errors import CollectiveTimeoutError, UsageError
from ..pipeline_schedules import Action, pipeline_order, stage_rank
from ..stage_program import PipelineRankProgram, StageProgram, TensorSpec
from ..stage_routes import assemble, check_routes, cut, piece_shape
from .trace import TraceRecorder


def _needed_groups(program: PipelineRankProgram) -> set[tuple[int, ...]]:
    groups = {tuple(g) for g in program.grad_groups.values() if len(g) > 1}
    if len(program.batch_group) > 1:
        groups.add(tuple(program.batch_group))
    groups.update(tuple(g) for g in program.groups.values())  # 1-rank axes too: their collectives need a group
    return groups


def setup_pipeline_groups_or_gloo(program: PipelineRankProgram, timeout_s: float | None = None
                                  ) -> tuple[PipelineRankProgram, dict[tuple[int, ...], Any]]:
    """:func:`setup_pipeline_groups`, and the program to run: under ``--comm auto`` (``program.comm``), where some
    rank could not make one of its shared-memory groups (ShmCapacityError: /dev/shm filled after the lowering's check,
    or the artifacts compiled where it was larger), every rank puts all of them on gloo (all or nothing, as the
    lowering's :func:`~adaptdist.comm_transport.shm_space_fits`): agreed by one all_gather over the world
    (:func:`~adaptdist.runtime.shm_groups.agree_on_shortfalls`, bounded by ``timeout_s``), its groups destroyed, its
    stage programs' collectives rewritten for gloo and ``shm_groups`` emptied (the runtime's reductions then take
    gloo), with one warning. Other programs: ``(program, setup_pipeline_groups(program, timeout_s))``."""
    import dataclasses

    if program.comm != "auto":  # (the same on every rank: lowered together)
        return program, setup_pipeline_groups(program, timeout_s)
    from ..mesh import base_group_name
    from .shm_groups import ShmShortfall, agree_on_shortfalls, gloo_module, warn_gloo_fallback

    failed: dict[str, ShmShortfall] = {}
    groups = setup_pipeline_groups(program, timeout_s, on_capacity=lambda n, e: failed.setdefault(n, ShmShortfall.of(e)))
    agreed = agree_on_shortfalls(["pipeline"], {"pipeline": next(iter(failed.values()))} if failed else {}, timeout_s)
    if not agreed:
        return program, groups
    from ..kernels.shm import destroy_group, group_names

    live = set(group_names())
    for name in program.shm_groups:
        if name in live:
            destroy_group(name)
    gloo = {n: base_group_name(n) for n in program.shm_groups}
    stages = tuple(dataclasses.replace(st, forward=gloo_module(st.forward, gloo),
                                       backward_input=gloo_module(st.backward_input, gloo),
                                       backward_weight=gloo_module(st.backward_weight, gloo))
                   for st in program.stages)
    warn_gloo_fallback({f"the pipeline's {len(program.shm_groups)} groups on this host": agreed["pipeline"]})
    return dataclasses.replace(program, stages=stages, shm_groups={}), groups


def setup_pipeline_groups(program: PipelineRankProgram, timeout_s: float | None = None,
                          on_capacity: Callable[[str, Exception], None] | None = None
                          ) -> dict[tuple[int, ...], Any]:
    """(Collective over all ranks) create every process group any rank's program needs and register this rank's
    intra-stage collective groups under their names (``adaptdist:<axis>``).

    ``on_capacity(name, error)``: a shared-memory group /dev/shm has no room for is not made and reported to it, not
    raised (:func:`setup_pipeline_groups_or_gloo`).

    Returns:
        ``{ranks: ProcessGroup}`` for the groups this rank belongs to (ranks sorted ascending), plus ``()`` -> the
        world group.
    """
    mine = sorted(_needed_groups(program))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    union = sorted({tuple(sorted(g)) for gs in everyone for g in gs})
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    out: dict[tuple[int, ...], Any] = {(): dist.group.WORLD}
    for ranks in union:
        pg = dist.new_group(list(ranks), **kwargs)  # every rank calls it, in the same order
        if program.rank in ranks:
            out[ranks] = pg
    for name, ranks in program.groups.items():
        key = tuple(sorted(ranks))
        compat.register_process_group(name, out[key])
    if program.shm_groups:  # one global order (ranks, then name): no two ranks wait on each other in a cycle
        from .shm_groups import make_shm_groups

        order = sorted(program.shm_groups.items(), key=lambda kv: (tuple(kv[1]), kv[0]))
        make_shm_groups([n for n, _ in order], [(n, out[tuple(sorted(rs))]) for n, rs in order], timeout_s,
                        lambda unknown: "this rank's groups", on_capacity=on_capacity)
    return out


class PipelineStepRunner:
    """One rank's state, optimizer and pipeline step (the pipeline counterpart of ``worker.StepRunner``).

    Args:
        program: this rank's :class:`PipelineRankProgram`.
        optimizer, lr: passed to ``make_optimizer(optimizer, params, lr)`` (``worker.make_optimizer``; given by the
            caller, the worker importing this module).
        groups: :func:`setup_pipeline_groups`'s result.
        timeout_s: how long one send, receive or collective waits for its peer (the collective timeout).
        max_grad_norm: clip the gradients to this global 2-norm (over every stage and shard, as
            ``torch.nn.utils.clip_grad_norm_`` over the whole model; :mod:`.grad_clip`) before the optimizer step.
            Collective when set: every rank passes the same.

    Raises:
        UsageError: this rank's stages do not follow the schedule's stage placement (stage ``s`` on pipeline rank
            ``s % pp``).
        PipelineScheduleError: the schedule cannot run these numbers.
    """

    def __init__(self, program: PipelineRankProgram, optimizer: str, lr: float, groups: dict,
                 timeout_s: float = 120.0, max_grad_norm: float | None = None, *, make_optimizer):
        check_routes(program)
        self.program = program
        self.groups = groups
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = None
        self.norm_owned: frozenset[str] = frozenset()
        if max_grad_norm is not None:
            from .pipeline_programs import norm_owned_params

            self.norm_owned = norm_owned_params(program)
        self.state = {k: v.clone() for k, v in program.state.items()}
        self.params = [self.state[f] for f in program.param_fqns]
        # a rank whose stages hold no trainable parameter (frozen layers only; a head the loss does not use) still
        # runs its forward and backward; it has nothing to update (torch's optimizers refuse an empty list)
        self.opt = make_optimizer(optimizer, self.params, lr) if self.params else NoParameterOptimizer()
        self.last_grads: dict[str, torch.Tensor] = {}
        # rank set -> its shared-memory group (the runtime's reductions over it take the kernels)
        self.shm_names = {tuple(sorted(rs)): n for n, rs in sorted(program.shm_groups.items())}
        self.stages = {s.stage: s for s in program.stages}
        self.trace = TraceRecorder(program.rank, enabled=False)
        first = program.stages[0]
        per_rank = len(program.stages)
        self.num_stages = first.num_stages
        if self.num_stages % per_rank:
            raise UsageError(f"rank {program.rank} holds {per_rank} stages of {self.num_stages}: not a whole number of "
                             f"stages per pipeline rank")
        self.pp_size = self.num_stages // per_rank
        self.pp_rank = stage_rank(first.stage, self.pp_size)
        want = [s for s in range(self.num_stages) if stage_rank(s, self.pp_size) == self.pp_rank]
        if sorted(self.stages) != want:
            raise UsageError(f"rank {program.rank} holds stages {sorted(self.stages)}, but schedule "
                             f"{program.schedule} on {self.pp_size} pipeline ranks places stages {want} on its "
                             f"pipeline rank {self.pp_rank} (stage s on rank s % {self.pp_size})")
        self.actions = pipeline_order(program.schedule, self.pp_size, program.num_microbatches,
                                      per_rank)[self.pp_rank]
        last = program.stage_ranks[self.num_stages - 1]
        # one rank per replica reports the replica-summed loss: the lowest rank of the last stage
        self.reports_loss = program.rank == min(last)

    def use_trace(self, trace: TraceRecorder) -> None:
        """Record each action (F, B, I, W, send, recv), the gradient and loss all-reduces and the optimizer step
        into ``trace`` (``adaptdist train --trace``: the real run's pipeline timeline)."""
        self.trace = trace

    # -- communication -------------------------------------------------------------------------------------------
    def _tag(self, stage: int, backward: bool, mb: int, i: int) -> int:
        return ((stage * 2 + int(backward)) * self.program.num_microbatches + mb) * 64 + i

    def _wait(self, work, what: str, peer: int | None = None, ranks: Sequence[int] = ()) -> None:
        """Wait for ``work`` under the timeout; a failure names ``peer`` (point-to-point) or the group's ``ranks``."""
        t0 = time.monotonic()
        try:
            work.wait(self.timeout)
        except Exception as e:  # gloo: timed out / connection closed by a dead peer
            who = f"rank {peer}" if peer is not None else "one of ranks " + ", ".join(
                str(r) for r in ranks if r != self.program.rank)
            waited_s = time.monotonic() - t0
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            lost = waited_s < 0.9 * self.timeout_s  # not the timeout: the connection failed (a peer died or exited)
            if lost:
                how, why, fix = (f"failed after {waited_s:.1f} s", f"{who} closed the connection (it died or exited)",
                                 "check its log for the first error")
            else:
                how, why, fix = (f"timed out after {self.timeout_s:g} s", f"{who} stalled or died",
                                 "check its log, or raise --collective-timeout-s")
            raise CollectiveTimeoutError(
                f"rank {self.program.rank}: {what}{f' with rank {peer}' if peer is not None else ''} {how} ({text})"
                f": {why} (pipeline schedule {self.program.schedule}); {fix}",
                peer_global_rank=peer, peer_lost=lost) from e

    def _post_sends(self, tensors: Sequence[torch.Tensor], routes, peer: int | None, a: Action, backward: bool,
                    pending: list) -> None:
        """Post ``isend`` for each tensor (or, with ``routes``, each tensor's pieces to their peers in (tensor, peer)
        order; :mod:`adaptdist.stage_routes`) and return at once: the works go on ``pending``, holding their
        tensors alive until :meth:`_wait_sends` at the step's end."""
        h = self.trace.begin("send", stage=a.stage, microbatch=a.microbatch, peer=peer, posted=True)
        for i, t in enumerate(tensors):
            pieces = [(peer, t.contiguous())] if routes is None else cut(t, routes[i])
            for p, piece in pieces:
                work = dist.isend(piece, p, tag=self._tag(a.stage, backward, a.microbatch, i))
                what = f"send {a} (tensor {i}{'' if routes is None else f', piece to rank {p}'})"
                pending.append((work, piece, what, p))
        self.trace.end(h)

    def _wait_sends(self, pending: list) -> None:
        """Wait for every posted send (the receivers have each posted theirs: gloo's send completes only then)."""
        if not pending:
            return
        with self.trace.span("wait", on="send", messages=len(pending)):
            for work, _, what, peer in pending:
                self._wait(work, what, peer)
        pending.clear()

    def _post_recvs(self, specs: Sequence[TensorSpec], routes, peer: int | None, a: Action, backward: bool,
                    stage: int) -> "_PostedRecv":
        """Post ``irecv`` for each tensor (or its pieces from their peers, in (tensor, peer) order) into buffers
        allocated from ``specs``; returns at once. :meth:`_take` waits for them when the values are needed."""
        handle = self.trace.begin("recv", stage=a.stage, microbatch=a.microbatch, peer=peer, posted=True)
        works, parts = [], []
        for i, spec in enumerate(specs):
            if routes is None:
                bufs, peers = [spec.empty()], [peer]
            else:
                bufs = [torch.empty(piece_shape(spec.shape, p), dtype=spec.dtype) for p in routes[i].pieces]
                peers = [p.peer for p in routes[i].pieces]
            for buf, p in zip(bufs, peers):
                work = dist.irecv(buf, p, tag=self._tag(stage, backward, a.microbatch, i))
                works.append((work, f"receive {a} (tensor {i}{'' if routes is None else f', piece from rank {p}'})",
                              p))
            parts.append(bufs)
        values = tuple(b[0] for b in parts) if routes is None else None  # routed: assembled once received
        return _PostedRecv(a, works, parts, routes, specs, values, handle)

    def _take(self, store: dict, key: tuple[int, int]) -> tuple:
        """``store[key]``'s values (popped): a locally computed tuple as it is; posted receives waited for (the
        rank idles here, outside any compute span) and, for routed pieces, assembled."""
        v = store.pop(key)
        if not isinstance(v, _PostedRecv):
            return v
        with self.trace.span("wait", stage=v.action.stage, microbatch=v.action.microbatch, on="recv"):
            for work, what, peer in v.works:
                self._wait(work, what, peer)
        self.trace.end(v.trace_handle)
        if v.values is not None:
            return v.values
        return tuple(assemble(bufs, route, spec.shape, spec.dtype)
                     for bufs, route, spec in zip(v.parts, v.routes, v.specs))

    def _all_reduce(self, t: torch.Tensor, ranks: Sequence[int], op=dist.ReduceOp.SUM, what: str = "") -> None:
        """Sum (or max) ``t`` in place over ``ranks``: through shared memory when the program puts that rank set
        there (``shm_groups``) and the kernels reduce ``t``'s dtype and ``op``, else through gloo."""
        key = tuple(sorted(ranks))
        name = self.shm_names.get(key)
        shm_op = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}.get(op)
        if name is not None and shm_op is not None and t.dtype in _SHM_DTYPES:
            from ..kernels.shm import translate_error

            with self.trace.span("collective", op="all_reduce", what=what):
                try:
                    t.copy_(torch.ops.adaptdist.shm_all_reduce(t, shm_op, name))
                except RuntimeError as e:  # a peer died or stalled: the typed error naming it
                    typed = translate_error(e)
                    if typed is None:
                        raise
                    raise typed from e
            return
        with self.trace.span("collective", op="all_reduce", what=what):
            work = dist.all_reduce(t, op=op, group=self.groups[key], async_op=True)
            self._wait(work, f"all_reduce {what} over ranks {list(key)}", ranks=key)

    # -- the step ------------------------------------------------------------------------------------------------
    def _normalizers(self, global_batch: tuple) -> tuple:
        pro = self.program.prologue
        if pro is None:
            return ()
        outs = pro.module(*self.program.local_batch(global_batch))
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        group = self.program.batch_group
        if len(group) > 1:
            outs = tuple(o.clone() for o in outs)
            for i, (o, op) in enumerate(zip(outs, pro.reduce_ops)):
                name = pro.names[i] if i < len(pro.names) else f"normalizer {i}"
                reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
                self._all_reduce(o, group, reduce_op, name)
        return outs

    @torch.no_grad()
    def run_schedule(self, global_batch: tuple) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Run this rank's actions for one step (no gradient sync); returns (the sum of this rank's loss terms or
        None, {fqn: gradient accumulated over microbatches})."""
        prog = self.program
        normalizers = self._normalizers(global_batch)
        fwd_in: dict[tuple[int, int], tuple] = {}     # received activations
        fwd_out: dict[tuple[int, int], tuple] = {}    # activations to send
        grad_in: dict[tuple[int, int], tuple] = {}    # received output gradients
        grad_out: dict[tuple[int, int], tuple] = {}   # input gradients to send
        saved: dict[tuple[int, int], tuple] = {}
        saved_w: dict[tuple[int, int], tuple] = {}
        grads: dict[str, torch.Tensor] = {}
        loss = None

        def backward_input(st: StageProgram, mb: int) -> None:
            gs = () if st.is_last else grad_in.pop((st.stage, mb))
            outs = _tuple(st.backward_input(*saved.pop((st.stage, mb)), *gs))
            n = 0 if st.is_first else len(st.grad_out_specs)
            if not st.is_first:
                g = outs[:n]
                if st.recv_from == prog.rank:  # the previous stage is ours: no message
                    grad_in[(st.stage - 1, mb)] = g
                else:
                    grad_out[(st.stage, mb)] = g
            saved_w[(st.stage, mb)] = outs[n:]

        def backward_weight(st: StageProgram, mb: int) -> None:
            outs = _tuple(st.backward_weight(*saved_w.pop((st.stage, mb))))
            for f, g in zip(st.grad_fqns, outs):
                if f in grads:
                    grads[f].add_(g)
                else:
                    grads[f] = g.clone()  # owned: later microbatches add into it

        sends: list = []  # posted sends, waited at the end (gloo's send completes when the peer receives)
        for a in self.actions:
            st = self.stages[a.stage]
            key = (a.stage, a.microbatch)
            # wait for this action's received inputs before its span: the wait is idle, not compute
            if a.kind == "F" and not st.is_first:
                fwd_in[key] = self._take(fwd_in, key)
            elif a.kind in ("B", "I") and not st.is_last:
                grad_in[key] = self._take(grad_in, key)
            compute = a.kind in ("F", "B", "I", "W")  # sends/receives record their own spans
            with self.trace.span(a.kind, stage=a.stage, microbatch=a.microbatch) if compute else _NULL:
                if a.kind == "F":
                    recv = () if st.is_first else fwd_in.pop(key)
                    outs = _tuple(st.forward(*(self.state[n] for n in st.state_names), *recv,
                                             *prog.microbatch(global_batch, a.microbatch), *normalizers))
                    if st.is_last:
                        loss = outs[0] if loss is None else loss + outs[0]
                        saved[key] = outs[1:]
                    else:
                        n = len(st.send_specs)
                        if st.send_to == prog.rank:
                            fwd_in[(a.stage + 1, a.microbatch)] = outs[:n]
                        else:
                            fwd_out[key] = outs[:n]
                        saved[key] = outs[n:]
                elif a.kind == "B":
                    backward_input(st, a.microbatch)
                    backward_weight(st, a.microbatch)
                elif a.kind == "I":
                    backward_input(st, a.microbatch)
                elif a.kind == "W":
                    backward_weight(st, a.microbatch)
                else:
                    r = st.routes  # None, or stages of different sizes: pieces to / from several peers
                    if a.kind == "SEND_F":
                        self._post_sends(fwd_out.pop(key), r and r.send, st.send_to, a, False, sends)
                    elif a.kind == "RECV_F":
                        fwd_in[key] = self._post_recvs(st.recv_specs, r and r.recv, st.recv_from, a, False,
                                                       stage=a.stage - 1)
                    elif a.kind == "SEND_B":
                        self._post_sends(grad_out.pop(key), r and r.grad_out, st.recv_from, a, True, sends)
                    elif a.kind == "RECV_B":
                        grad_in[key] = self._post_recvs(st.grad_in_specs, r and r.grad_in, st.send_to, a, True,
                                                        stage=a.stage + 1)
                    else:
                        raise AssertionError(f"unknown pipeline action {a}")
        self._wait_sends(sends)
        assert not (fwd_in or fwd_out or grad_in or grad_out or saved or saved_w), "schedule left values behind"
        return loss, grads

    def _sync_grads(self, grads: dict[str, torch.Tensor]) -> None:
        by_group: dict[tuple[int, ...], list[str]] = {}
        for f in grads:
            g = tuple(sorted(self.program.grad_groups.get(f, (self.program.rank,))))
            if len(g) > 1:
                by_group.setdefault(g, []).append(f)
        for g in sorted(by_group):  # one global order of groups: no cross-group wait cycle
            names = sorted(by_group[g])
            flat = torch.cat([grads[f].reshape(-1) for f in names])
            self._all_reduce(flat, g, what=f"gradients of {', '.join(names[:3])}{'...' if len(names) > 3 else ''}")
            off = 0
            for f in names:
                n = grads[f].numel()
                grads[f] = flat[off:off + n].view_as(grads[f])
                off += n

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if loss is not None:
            total = loss.detach().to(torch.float64).clone()
            if len(self.program.batch_group) > 1:
                self._all_reduce(total, self.program.batch_group, what="the loss")
            if self.reports_loss:
                value = total
        if dist.get_world_size() > 1:
            work = dist.all_reduce(value, async_op=True)
            self._wait(work, "the loss all_reduce (every rank)", ranks=range(dist.get_world_size()))
        return float(value)

    def step(self, global_batch: tuple[torch.Tensor, ...]) -> float:
        """One training step on ``global_batch`` (every rank passes the same); returns the global loss (every rank).

        Raises:
            CollectiveTimeoutError: a peer did not send, receive or reduce within the timeout (named).
        """
        loss, grads = self.run_schedule(global_batch)
        self._sync_grads(grads)
        missing = [f for f in self.program.param_fqns if f not in grads]
        if missing:
            raise UsageError(f"rank {self.program.rank}: the stage programs returned no gradient for "
                             f"{', '.join(missing[:5])}: a bug in the stage cut (its grad_fqns)")
        self.last_grads = {f: grads[f] for f in self.program.param_fqns}
        if self.max_grad_norm is not None:
            self._clip(self.last_grads)
        for p, f in zip(self.params, self.program.param_fqns):
            p.grad = grads[f]
        with self.trace.span("optimizer"):
            self.opt.step()
        for p in self.params:
            p.grad = None
        return self._global_loss(loss)

    def _clip(self, grads: dict[str, torch.Tensor]) -> None:
        """Scale ``grads`` in place to the global norm ``max_grad_norm`` (one world all-reduce of a scalar)."""
        from .grad_clip import owned_squares, scale_grads_

        sq = owned_squares(grads, self.norm_owned)
        if dist.get_world_size() > 1:
            with self.trace.span("collective", op="all_reduce", what="the gradient norm"):
                work = dist.all_reduce(sq, async_op=True)
                self._wait(work, "the gradient norm all_reduce (every rank)", ranks=range(dist.get_world_size()))
        self.last_grad_norm = float(sq.sqrt())
        scale_grads_(grads.values(), self.last_grad_norm, self.max_grad_norm)

    def optimizer_state_by_fqn(self) -> dict:
        """The optimizer's per-parameter state keyed by parameter name (for checkpoints)."""
        sd = self.opt.state_dict()
        return {self.program.param_fqns[i]: s for i, s in sd["state"].items()}


class NoParameterOptimizer:
    """The optimizer of a pipeline rank whose stages hold no trainable parameter: its step does nothing and its state
    is empty (``state_dict()`` ``{"state": {}, "param_groups": []}``), so the step, the checkpoints (which save no
    optimizer state for it) and a resume treat it like any optimizer over no parameters."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = []
        self.state: dict = {}

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("state"):
            raise UsageError(f"optimizer state for {len(state_dict['state'])} parameter(s) given to the optimizer of "
                             "a pipeline rank that holds no trainable parameter")


_NULL = contextlib.nullcontext()  # immutable: safe to share
_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels reduce (adaptdist.kernels.shm)


@dataclass
class _PostedRecv:
    """The ``irecv`` works of one ``RECV_*`` action, posted and not yet waited for (:meth:`PipelineStepRunner._take`):
    ``works`` ``(work, what, peer)``; ``parts`` per tensor its buffers (one, or a routed tensor's pieces, with
    ``routes`` and ``specs`` to assemble them); ``values`` the tensors when no assembly is needed."""

    action: Action
    works: list
    parts: list
    routes: Any
    specs: Sequence[TensorSpec]
    values: tuple | None
    trace_handle: Any


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
