"""Routes of the tensors crossing a boundary between two pipeline stages on sub-meshes of different sizes.

Where two adjacent stages run on the same sub-mesh, rank ``j`` of one stage exchanges whole tensors with rank ``j``
of the other (:attr:`~adaptdist.stage_program.StageProgram.send_to` / ``recv_from``). Where their data-parallel
sizes differ (stage 0 on 2 ranks, stage 1 on 1: ``--stage-ranks 2,1``), each microbatch's batch rows are spread
over a different number of replicas on each side, so every tensor is resharded at the boundary:

- a tensor sharded over the batch rows (``Shard(k)`` over the data-parallel axis: ``k`` is the dim whose local size
  is ``L / dp`` on a stage of ``dp`` replicas, ``L`` the microbatch's whole length along it) is cut by the sender
  into the pieces each receiver holds and concatenated by the receiver along ``k``, in sender order;
- a tensor the same on every replica (``Replicate``: a forward value computed from parameters only) goes whole from
  sender ``r % dp_sender`` to receiver ``r``;
- a gradient of such a value is a per-replica partial sum (``Partial``): receiver ``a`` adds what the senders
  ``b`` with ``b % dp_receiver == a`` send it (zeros where none does), so the total over the replicas is unchanged;
- so is a forward value that is ``Partial`` over the batch rows (a loss term reduced on an earlier stage, e.g.
  ``0.1 * feat.pow(2).mean()`` of the trunk's output: each replica's sum over its rows): summed like a gradient, not
  copied (the lowering passes each tensor's placement on the batch axis, ``combines`` of :func:`boundary_routes`).

Deadlock freedom: the schedules' lists are proven to terminate with one blocking message per stage-level exchange
(:func:`adaptdist.pipeline_schedules.check_deadlock_free`). Here one exchange is a set of messages between the two
stages' replica groups, all posted in the same action of the list; each sender posts its pieces in (tensor,
receiver rank) order and each receiver in (tensor, sender rank) order, so the pending message that is least in
(tensor, sender, receiver) order is always the next one of both its ends: the exchange completes with rendezvous
semantics too. The executor posts them (``isend``/``irecv``, waited later), which needs less than that.

Data model (pure, no process group): :class:`Piece`, :class:`TensorRoute`, :class:`StageRoutes`, their JSON forms,
and the functions that cut (:func:`cut`) and assemble (:func:`assemble`) tensors; the lowering builds them
(:func:`boundary_routes`), the executor and :func:`~adaptdist.runtime.simulate_pipeline.simulate_pipeline` run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import PipelineError

SPLIT, COPY, SUM = "cat", "copy", "sum"


@dataclass(frozen=True)
class Piece:
    """One message of one tensor: to (or from) global rank ``peer``, the slice ``[start, start + length)`` of dim
    ``dim`` of the local tensor (sender) or of the assembled tensor (receiver); ``dim`` None: the whole tensor."""

    peer: int
    dim: int | None = None
    start: int = 0
    length: int = 0

    def to_doc(self) -> list:
        return [self.peer, self.dim, self.start, self.length]


@dataclass(frozen=True)
class TensorRoute:
    """The pieces of one tensor in posting order and, on the receiving side, how they combine: ``"cat"`` along
    their dim, ``"copy"`` (one whole piece) or ``"sum"`` (partial sums; zeros when there is no piece)."""

    pieces: tuple[Piece, ...]
    combine: str = COPY

    def to_doc(self) -> dict:
        return {"pieces": [p.to_doc() for p in self.pieces], "combine": self.combine}


@dataclass(frozen=True)
class StageRoutes:
    """A stage's routes per tensor: ``send`` (forward, to the next stage), ``recv`` (forward, from the previous),
    ``grad_in`` (gradients from the next stage), ``grad_out`` (gradients to the previous); each in the order of the
    corresponding specs of :class:`~adaptdist.stage_program.StageProgram`."""

    send: tuple[TensorRoute, ...] = ()
    recv: tuple[TensorRoute, ...] = ()
    grad_in: tuple[TensorRoute, ...] = ()
    grad_out: tuple[TensorRoute, ...] = ()

    def to_doc(self) -> dict:
        return {k: [r.to_doc() for r in getattr(self, k)] for k in ("send", "recv", "grad_in", "grad_out")}

    @staticmethod
    def from_doc(doc: Any) -> "StageRoutes":
        """The inverse of :meth:`to_doc`. Raises PipelineError on a malformed document."""
        try:
            return StageRoutes(**{k: tuple(TensorRoute(tuple(Piece(int(p[0]), None if p[1] is None else int(p[1]),
                                                                   int(p[2]), int(p[3])) for p in r["pieces"]),
                                                       str(r["combine"])) for r in doc[k])
                                  for k in ("send", "recv", "grad_in", "grad_out")})
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PipelineError(f"malformed pipeline stage routes {str(doc)[:200]!r}: {e}") from e

    def peers(self) -> set[int]:
        return {p.peer for k in ("send", "recv", "grad_in", "grad_out") for r in getattr(self, k) for p in r.pieces}


def cut(t: torch.Tensor, route: TensorRoute) -> list[tuple[int, torch.Tensor]]:
    """The (peer, contiguous tensor) messages a sender posts for ``t``, in order."""
    return [(p.peer, (t if p.dim is None else t.narrow(p.dim, p.start, p.length)).contiguous())
            for p in route.pieces]


def piece_shape(shape: Sequence[int], p: Piece) -> tuple[int, ...]:
    """The shape of piece ``p`` of a tensor of ``shape``."""
    out = list(shape)
    if p.dim is not None:
        out[p.dim] = p.length
    return tuple(out)


def assemble(parts: Sequence[torch.Tensor], route: TensorRoute, shape: Sequence[int],
             dtype: torch.dtype) -> torch.Tensor:
    """The received tensor of ``shape`` from the pieces ``parts`` (in ``route``'s order)."""
    if route.combine == SPLIT:
        return torch.cat(list(parts), dim=route.pieces[0].dim) if len(parts) > 1 else parts[0]
    if route.combine == SUM:
        if not parts:
            return torch.zeros(tuple(shape), dtype=dtype)
        out = parts[0].clone()
        for x in parts[1:]:
            out.add_(x)
        return out
    return parts[0]


def _batch_dim(a: Sequence[int], b: Sequence[int], dp_a: int, dp_b: int) -> int | None | str:
    """The dim along which a tensor of local shape ``a`` on ``dp_a`` replicas and ``b`` on ``dp_b`` replicas is
    split over the batch rows; None when both are the same (not split); ``"?"`` when neither fits."""
    if len(a) != len(b):
        return "?"
    diff = [k for k, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
        return None
    if len(diff) == 1 and a[diff[0]] * dp_a == b[diff[0]] * dp_b:
        return diff[0]
    return "?"


def boundary_routes(kind: str, names: Sequence[str], send_shapes: Sequence[Sequence[int]],
                    recv_shapes: Sequence[Sequence[int]], senders: Sequence[int], receivers: Sequence[int],
                    where: str, combines: Sequence[str | None] | None = None
                    ) -> tuple[list[list[TensorRoute]], list[list[TensorRoute]]]:
    """Routes of one boundary's tensors from ``senders`` (the global ranks of one model-parallel coordinate of the
    sending stage, in data-parallel order) to ``receivers`` (likewise on the receiving stage). An unsplit tensor
    (the same local shape on both sides) is replicated (``COPY``: each receiver copies one sender's) or a
    per-replica partial sum (``SUM``: each sender's goes to one receiver, which adds what it gets, zeros where
    nothing comes, so the total over the replicas is unchanged), as ``combines[i]`` says (from the value's placement
    on the batch axis); where that is None (or ``combines`` is), by ``kind``: ``"forward"`` copies (a value of
    parameters only), ``"backward"`` sums (the gradient of such a value). A forward partial is e.g. a loss term
    reduced on an earlier stage (``0.1 * feat.pow(2).mean()`` over the replica's rows of the microbatch): copying it
    would count one replica's term on every receiver.
    Returns (per sender: its send routes per tensor, per receiver: its receive routes per tensor).

    Raises:
        PipelineError: a tensor whose two local shapes are not one batch split of the other (names it, ``where``).
    """
    dp_a, dp_b = len(senders), len(receivers)
    send = [[] for _ in senders]
    recv = [[] for _ in receivers]
    combines = list(combines) if combines is not None else [None] * len(names)
    for name, sa, sb, how in zip(names, send_shapes, recv_shapes, combines):
        k = _batch_dim(sa, sb, dp_a, dp_b)
        if k == "?":
            raise PipelineError(f"{where}: {kind} value {name!r} is {list(sa)} on each of the sending stage's {dp_a} "
                                f"replica(s) but {list(sb)} on each of the receiving stage's {dp_b}: not one batch "
                                "split of the other, so it cannot be resharded between the stages; give both stages "
                                "the same sub-mesh")
        if k is None:
            if (how or (COPY if kind == "forward" else SUM)) == COPY:  # receiver b copies sender b % dp_a's
                for a in range(dp_a):
                    send[a].append(TensorRoute(tuple(Piece(receivers[b]) for b in range(dp_b) if b % dp_a == a)))
                for b in range(dp_b):
                    recv[b].append(TensorRoute((Piece(senders[b % dp_a]),), COPY))
            else:  # partial sums: sender a's goes to receiver a % dp_b, which adds all it gets
                for a in range(dp_a):
                    send[a].append(TensorRoute((Piece(receivers[a % dp_b]),)))
                for b in range(dp_b):
                    recv[b].append(TensorRoute(tuple(Piece(senders[a]) for a in range(dp_a) if a % dp_b == b), SUM))
            continue
        total = sa[k] * dp_a
        la, lb = total // dp_a, total // dp_b
        for a in range(dp_a):
            pieces = []
            for b in range(dp_b):
                lo, hi = max(a * la, b * lb), min((a + 1) * la, (b + 1) * lb)
                if lo < hi:
                    pieces.append(Piece(receivers[b], k, lo - a * la, hi - lo))
            send[a].append(TensorRoute(tuple(pieces), SPLIT))
        for b in range(dp_b):
            pieces = []
            for a in range(dp_a):
                lo, hi = max(a * la, b * lb), min((a + 1) * la, (b + 1) * lb)
                if lo < hi:
                    pieces.append(Piece(senders[a], k, lo - b * lb, hi - lo))
            recv[b].append(TensorRoute(tuple(pieces), SPLIT))
    return send, recv


def check_routes(program: Any) -> None:
    """Raise :class:`PipelineError` when a stage of ``program`` (a
    :class:`~adaptdist.stage_program.PipelineRankProgram`) borders a stage of another size but holds no routes
    (a program saved in a format that drops them): its whole-tensor sends would not match its peers'."""
    ranks = program.stage_ranks
    for st in program.stages:
        for other in (st.stage - 1, st.stage + 1):
            if other in ranks and len(ranks[other]) != len(ranks[st.stage]) and st.routes is None:
                raise PipelineError(
                    f"rank {program.rank}: pipeline stage {st.stage} ({len(ranks[st.stage])} rank(s)) borders stage "
                    f"{other} ({len(ranks[other])}) but its program has no routes for the resharding between them "
                    "(saved in a format that does not keep StageProgram.routes?); compile again")

