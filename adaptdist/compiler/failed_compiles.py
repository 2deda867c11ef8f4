"""A rank whose Dynamo trace fails still tells the other ranks (the torch.compile backend, issue 14).

Under the backend each rank traces the model on its own inputs. When one rank passes an input the model cannot take
(rank 1's batch has 7 features where rank 0's has 8, and the model's first Linear takes 8), Dynamo's trace raises on
that rank before it reaches the backend, so that rank never announces the compile
(:mod:`adaptdist.runtime.graph_agreement`), while the other ranks compile the graph and wait for it in their
announcement: they would stop only at the collective timeout, and the failing rank would stop with Dynamo's raw
fake-tensor error (``mat1 and mat2 shapes cannot be multiplied``) that names neither the rank nor the other shapes.

:func:`announce_failed_compile`, a Dynamo end-of-compile callback, announces the failure instead
(:data:`~adaptdist.runtime.graph_agreement.FAILED`, with a digest of this rank's input shapes) and joins the exchange
that follows, so every rank raises at once: :class:`~adaptdist.errors.RankInputMismatchError` naming the input and
each rank's shape where the shapes differ, :class:`~adaptdist.errors.RankDivergenceError` otherwise. When every rank
failed alike (the same shapes: a bug in the model, as one process would meet it), each rank's Dynamo error goes on
unchanged.

Before (2 gloo ranks, rank 1's batch ``float32[4, 7]`` for a Linear(8, ...)): rank 1 raised TorchRuntimeError
("mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16)") at once, rank 0 a CollectiveTimeoutError after the
collective timeout. After: both raise RankInputMismatchError at once ("rank 1 could not compile the model on its
inputs, whose shapes differ from the other ranks': L['x'] is float32[4, 8] on rank 0 but float32[4, 7] on rank 1;
...").
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from ..errors import CollectiveTimeoutError, RankDivergenceError
from ..runtime import graph_agreement

MAX_DEPTH = 3  # how deep into the frame's tuple/list/dict arguments the input shapes are read


def announce_failed_compile(_args: Any = None) -> None:
    """Dynamo callback, at the end of every frame compile: when this compile, one of the adaptdist backend's on a
    frame that trains (a module with trainable parameters or a tensor that requires grad in its locals), failed
    before the backend in a job of several ranks, announce it (module docstring).

    Raises:
        RankInputMismatchError: on every rank, the ranks' inputs differ in shape or dtype (names the input, each
            rank's shape, what to do).
        RankDivergenceError: on every rank, the other ranks compiled or ran something else.
        CollectiveTimeoutError: the other ranks did not announce within the collective timeout (names this rank's
            failed compile and its error).
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    failed = compat.dynamo_failed_compile()
    if failed is None:
        return
    backend, code, f_locals, error = failed
    # the adaptdist backend marks itself (dynamo_backend imports this module: no import back)
    if not getattr(backend, "announces_failed_compiles", False) or not _trains(f_locals):
        return  # another backend's compile, or a graph the backend would run as it is (announcing nothing)
    shapes = frame_input_shapes(f_locals)
    text = json.dumps([[n, d, list(s)] for n, d, s in shapes])
    cause = _cause_text(error)
    frame = f"frame {code.co_name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
    listed = ", ".join(f"{n} {d}{list(s)}" for n, d, s in shapes)

    def describe() -> str:
        return graph_agreement.unit_text(graph_agreement.FAILED,
                                         f"{frame}, inputs [{listed}] ({cause})")

    try:
        graph_agreement.announce(graph_agreement.FAILED, graph_agreement.graph_id(text), describe, lambda: text)
    except (RankDivergenceError, CollectiveTimeoutError) as e:
        e.__cause__ = error
        compat.raise_at_frame_compile_end(e)
    # every rank failed alike: Dynamo's error goes on, as in one process


def _cause_text(error: BaseException) -> str:
    """``Type: first line`` of the innermost cause of ``error``: Dynamo's TorchRuntimeError is raised ``from None``
    while it handles the fake tensor's RuntimeError, whose text names the shapes (``a and b must have same reduction
    dim, but got [4, 11] X [12, 24]``): its cause, else its context, up to 5 deep."""
    inner = error
    for _ in range(5):
        nxt = inner.__cause__ or inner.__context__
        if nxt is None or nxt is inner:
            break
        inner = nxt
    return f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0][:300]}"


def _trains(f_locals: dict[str, Any]) -> bool:
    """Whether the backend would compile this frame's graph into a program (not run it as it is: it then announces
    nothing, and neither may this rank): a module with trainable parameters, or a tensor that requires grad, among
    the frame's locals."""
    for value in f_locals.values():
        if isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters()):
            return True
    return any(t.requires_grad for _, t in _tensors(f_locals))


def frame_input_shapes(f_locals: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors among a frame's locals at entry (its arguments), named as Dynamo names the graph inputs it lifts
    from them (``L['x']``, ``L['kwargs']['input_ids']``, ``L['args'][0]``), with dtype and shape: the
    :data:`~adaptdist.runtime.rank_input_shapes.InputShape` of each; modules and their parameters are left out."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in _tensors(f_locals)]


def _tensors(f_locals: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []

    def walk(name: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif depth < MAX_DEPTH and isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v, depth + 1)
        elif depth < MAX_DEPTH and isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    walk(f"{name}[{k!r}]", v, depth + 1)

    for key, value in f_locals.items():
        if isinstance(key, str) and not isinstance(value, torch.nn.Module):
            walk(f"L[{key!r}]", value, 0)
    return out
