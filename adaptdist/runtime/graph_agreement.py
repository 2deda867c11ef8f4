"""Ranks agree on which compiled graph they enter, before its collectives (the torch.compile backend).

Under the backend each rank runs Dynamo on its own inputs, so two ranks can reach different graphs at
the same point of a step: a branch on data taken differently (``if x.mean() > 0``, a graph break, then
a different resume function), or a recompile on some ranks only (a guard that fails on one rank: an
uneven last batch, a Python value that differs). The compiled graphs run collectives that every rank
must join, in the same order; if rank 1 compiles a new graph (its compile agrees with the other ranks
through collectives) while rank 0 runs the graph it compiled earlier, the two ranks issue different
collectives, and gloo aborts the process ("Received data size doesn't match expected size", SIGABRT) or
waits until the collective timeout.

The protocol. A **unit** is a sequence of collectives that is the same on every rank that enters it
with the same id: the compile of a graph (:data:`COMPILE`), the forward of a compiled graph
(:data:`FORWARD`) and its backward (:data:`BACKWARD`). Every unit that issues a collective starts with
:func:`announce`: one ``all_gather`` of ``int64[2] = (kind, graph id)`` over the world group, the same
collective on every rank whatever the unit. Every collective adaptdist issues belongs to a unit, so the
ranks' collective streams are equal up to the first communicating unit whose announcements differ (by
induction over units: a unit that issues no collective, such as the forward of a data-parallel graph,
adds nothing to a rank's stream and needs no announcement), and at that unit every rank is inside the
same announce collective: each rank sees all announcements, so all of them stop together, with one
:class:`~adaptdist.errors.RankDivergenceError` naming each rank's graph, after one more exchange of
descriptions (every rank takes that error path, so the exchange matches too). No rank is left inside a
collective of the old graph: it never started one. A rank that skipped a silent forward meets the
compiling rank at its next announcement (the backward, or the next graph's forward).

The other option, letting the rank that does not recompile block in the old graph's collective until the
collective timeout and then explain the timeout, is not sound on gloo: the two collectives usually meet
(same group, next sequence number) with different sizes, and gloo aborts the process instead of timing out.

What is not a unit: a graph run as it is on each rank (``dynamo_backend._runs_as_is``: no collectives,
DDP's per-rank computation), so its compile announces nothing either (ranks may diverge in such code, as
under DDP); and the user's own collectives, which adaptdist cannot order: divergent Python code that
calls ``dist.all_reduce`` itself can still meet an announcement.

A rank whose compile fails before it reaches the backend (Dynamo's own trace raised: an input of a shape the
model does not take, on this rank only) still announces, :data:`FAILED` with a digest of its inputs' shapes (from
an end-of-compile callback, :mod:`adaptdist.compiler.failed_compiles`), so the other ranks stop at their next
announcement at once instead of waiting out the collective timeout. The exchange after a mismatch carries each
rank's user input shapes too, and where they differ every rank raises
:class:`~adaptdist.errors.RankInputMismatchError` naming the input and each rank's shape. When every rank failed
alike (the same shapes: the model's own bug), no rank raises here and each raises Dynamo's error as one process would.

Cost: one ``all_gather`` of 16 bytes per compiled graph per training step under a data-parallel plan (before the
backward: the forward communicates only at the first call), two under plans whose forward communicates (fsdp,
tp); a gloo round trip each (``benchmarks/bench_graph_agreement.py``; figures in ``benchmarks/RESULTS.md``). The graph id is the hash of the graph signature the ranks agreed on at
compile (:func:`graph_id`), so it is equal on every rank that compiled the same graph.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError, RankDivergenceError, RankInputMismatchError
from .rank_input_shapes import InputShape, input_shape_mismatch_hint, parse_input_shapes

COMPILE, FORWARD, BACKWARD, FAILED = 1, 2, 3, 4


def graph_id(signature: str) -> int:
    """A 60-bit id (fits int64) of a compiled graph from the signature its ranks agreed on: equal on every rank."""
    return int(hashlib.sha256(signature.encode()).hexdigest()[:15], 16)


def _device() -> torch.device:
    """Where the announcement tensor lives: the world group's backend moves CPU tensors on gloo, CUDA on nccl."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_text(text: str, group: Any = None, device: torch.device | None = None) -> list[str]:
    """Every rank's ``text`` (a collective over ``group``: every rank calls it); ``device``: where the tensors
    live (CPU, the default, for gloo groups)."""
    device = device or torch.device("cpu")
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:int(s.item())].tolist()).decode() for p, s in zip(parts, sizes)]


def announce(kind: int, gid: int, describe: Callable[[], str], inputs: Callable[[], str] | None = None) -> None:
    """Start a unit (module docstring): tell every rank which unit this rank enters, and stop unless every
    rank enters the same one. Ranks that all compile (each a graph of its own, maybe) pass: the compile's
    own agreement compares their graphs. A collective over the world group; a no-op in a world of one.

    Args:
        kind: :data:`COMPILE`, :data:`FORWARD`, :data:`BACKWARD`, or :data:`FAILED` (this rank's compile failed
            before the backend: it announces so that no rank waits for it, then raises).
        gid: the graph's :func:`graph_id` (0 for a compile: the graph is not known yet; for :data:`FAILED`, the
            :func:`graph_id` of its inputs' shapes, so that ranks that failed alike agree).
        describe: this rank's unit in words (the graph, its frame and lines), called only on a mismatch.
        inputs: this rank's user inputs as :func:`~adaptdist.runtime.rank_input_shapes.input_shapes_text` (JSON),
            called only on a mismatch; None: not known.

    Raises:
        RankInputMismatchError: on every rank, when the ranks announced different units and their user inputs
            differ in shape or dtype: names the input, each rank's shape and dtype, and what to do.
        RankDivergenceError: on every rank, when the ranks announced different units: names the ranks of
            each unit, its graph and frame, and what to do.
        CollectiveTimeoutError: a rank did not announce within the collective timeout, or left (names this
            rank's unit: the ranks are where the timeout's message says).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = _device()
    mine = torch.tensor([kind, gid], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(parts, mine)
    except RuntimeError as e:
        raise CollectiveTimeoutError(
            f"rank {dist.get_rank()}, about to {describe()}, waited for the other ranks and they did not come "
            f"({str(e).splitlines()[0][:300]}): a rank stopped, or is running code of its own (a branch on data taken "
            "differently that reaches no compiled graph, or collectives of the script's own). Make every rank take "
            "the same path through the compiled model") from None
    rows = [tuple(p.tolist()) for p in parts]
    if len(set(rows)) == 1 or all(k == COMPILE for k, _ in rows):
        return
    # every rank saw the same rows: every rank is here, and exchanges its description and its inputs' shapes
    texts = all_gather_text(json.dumps([describe(), inputs() if inputs is not None else ""]), device=device)
    described, shapes = zip(*(json.loads(t) for t in texts))
    raise divergence_error(rows, list(described), [parse_input_shapes(t) if t else None for t in shapes],
                           dist.get_rank())


def divergence_error(rows: list[tuple[int, int]], texts: list[str], shapes: list[list[InputShape] | None],
                     rank: int) -> RankDivergenceError:
    """The error every rank raises for announcements ``rows[r] = (kind, graph id)``, descriptions ``texts[r]`` and
    user inputs ``shapes[r]`` (None where a rank did not say), seen by ``rank``: a
    :class:`~adaptdist.errors.RankInputMismatchError` where the inputs the ranks share by name differ in shape or
    dtype, else a :class:`~adaptdist.errors.RankDivergenceError` (:func:`divergence_message`)."""
    hint = inputs_hint(shapes)
    if not hint:
        return RankDivergenceError(divergence_message(rows, texts, rank))
    groups: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    failed = [r for r, (k, _) in enumerate(rows) if k == FAILED]
    where = "; ".join(f"{_ranks(rs)}: about to {texts[rs[0]]}" for rs in groups.values())
    head = (f"{_ranks(failed)} could not compile the model on {'its' if len(failed) == 1 else 'their'} inputs, "
            "whose shapes differ from the other ranks'" if failed else
            "the ranks reached different compiled graphs because their inputs differ")
    return RankInputMismatchError(
        f"{head}: {hint} ({where}). Every compiled graph runs collectives that all ranks must join, so adaptdist "
        f"stops every rank here (this is rank {rank}) rather than leave one waiting for the collective timeout")


def inputs_hint(shapes: list[list[InputShape] | None]) -> str:
    """The text naming a user input whose shape or dtype differs between ranks, comparing the inputs every rank
    named (a rank whose compile failed names every tensor of its frame, a compiled graph the tensors it reads),
    or "" when they agree or a rank did not say (:func:`~adaptdist.runtime.rank_input_shapes.input_shape_mismatch_hint`)."""
    if not shapes or any(s is None for s in shapes):
        return ""
    common = set.intersection(*({n for n, _, _ in s} for s in shapes))
    order = list(dict.fromkeys(n for n, _, _ in shapes[0] if n in common))  # rank 0's order, each name once
    by_name = [{n: (n, d, sh) for n, d, sh in s} for s in shapes]
    hint = input_shape_mismatch_hint([[named[n] for n in order] for named in by_name])
    return hint.removeprefix(". The ranks' inputs differ: ")


def divergence_message(rows: list[tuple[int, int]], texts: list[str], rank: int) -> str:
    """The error text for announcements ``rows[r] = (kind, graph id)`` and descriptions ``texts[r]``, seen by
    ``rank``: each group of ranks with its unit, then why and what to do."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    parts = [f"{_ranks(rs)}: about to {texts[rs[0]]}" for rs in groups.values()]
    compiling = [r for r, (k, _) in enumerate(rows) if k == COMPILE]
    failed = [r for r, (k, _) in enumerate(rows) if k == FAILED]
    if failed:
        return ("the ranks reached different points of the step: " + "; ".join(parts) + ". " + _ranks(failed)
                + " could not compile the model (Dynamo's trace stopped with the error named) where the other ranks "
                "did or ran a graph compiled earlier. Every compiled graph runs collectives that all ranks must join, "
                f"so adaptdist stops every rank here (this is rank {rank}). Fix the error on the rank that failed; if "
                "it fails only there, give every rank the same model and inputs of the same shapes and dtypes")
    why = (_ranks(compiling) + (" compiles" if len(compiling) == 1 else " compile") + " a graph the other ranks do "
           "not: the ranks took different paths "
           "through the Python code (a branch on data taken differently, after a graph break), or a guard failed on "
           "some ranks only (an input of another shape, a Python value that differs) and Dynamo recompiles there"
           if compiling else "the ranks took different paths through the Python code (a branch on data taken "
           "differently, after a graph break)")
    return ("the ranks reached different compiled graphs at the same point of the step: " + "; ".join(parts) + ". "
            + why + ". Every compiled graph runs collectives that all ranks must join, so adaptdist stops every rank "
            "here (this is rank " + str(rank) + "). Make the decision the same on every rank (compute it from a value "
            "all_reduce'd across ranks), or compute both sides and select with torch.where(cond, a, b) so that there "
            "is no graph break; give every rank inputs of the same shapes (drop_last=True); TORCH_LOGS=graph_breaks,"
            "recompiles shows where Dynamo splits and recompiles the model")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def unit_text(kind: int, what: str) -> str:
    """``what`` (a graph and its frame) as the unit ``kind`` of it, for :func:`announce`'s ``describe``."""
    return {COMPILE: f"compile a new graph for {what}", FORWARD: f"run the forward of {what}",
            BACKWARD: f"run the backward of {what}", FAILED: f"report that its compile of {what} failed"}[kind]
