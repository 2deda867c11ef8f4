"""The torch.compile backend's check that every rank passes user inputs of the same shapes.

The backend compiles one program for all ranks (each rank's rows are one slice of a leading rank dim), so the
ranks' inputs must have equal shapes; uneven per-rank batches (3 + 2 rows of a global batch of 5) make the ranks
capture different graphs. When they do, the advice names the input and both shapes instead of guessing at a
graph break.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

InputShape = tuple[str, str, tuple[int, ...]]
"""One user input of one rank: (source text, e.g. ``L['input_ids']``; dtype text, e.g. ``int64``; shape)."""


def input_shapes_text(inputs: Sequence[Any]) -> str:
    """This rank's user inputs (``GraphInput`` of kind ``input``) as JSON text, for exchanging between ranks."""
    return json.dumps([[i.fqn, str(i.dtype).removeprefix("torch."), list(i.global_shape)]
                       for i in inputs if i.kind == "input"])


def parse_input_shapes(text: str) -> list[InputShape]:
    """The inverse of :func:`input_shapes_text`."""
    return [(name, dtype, tuple(shape)) for name, dtype, shape in json.loads(text)]


def input_shape_mismatch_hint(per_rank: Sequence[Sequence[InputShape]]) -> str:
    """The advice for ranks whose user inputs differ in shape or dtype (rank r's inputs ``per_rank[r]``), or ""
    when every rank's are the same.

    Example: ``L['input_ids']`` ``int64[3, 8]`` on rank 0 and ``int64[2, 8]`` on rank 1 (a global batch of 5
    split 3 + 2) gives ". The ranks' inputs differ: L['input_ids'] is int64[3, 8] on rank 0 but int64[2, 8] on
    rank 1 (rows per rank: 3, 2). The torch.compile backend requires ... a fixed batch size ...".
    """
    if not per_rank or all(list(r) == list(per_rank[0]) for r in per_rank):
        return ""
    ref = list(per_rank[0])
    for rank, inputs in enumerate(per_rank):
        inputs = list(inputs)
        if inputs == ref:
            continue
        if [n for n, _, _ in inputs] != [n for n, _, _ in ref]:
            return (f". The ranks pass different inputs: rank 0 {[n for n, _, _ in ref]}, rank {rank} "
                    f"{[n for n, _, _ in inputs]}; every rank must call the compiled model with the same arguments")
        k = next(k for k, (a, b) in enumerate(zip(ref, inputs)) if a != b)
        name, dtype0, shape0 = ref[k]
        _, dtype1, shape1 = inputs[k]
        rows = ", ".join(str(r[k][2][0]) if len(r) > k and r[k][2] else "?" for r in per_rank)
        total = sum(r[k][2][0] for r in per_rank if len(r) > k and r[k][2])
        world = len(per_rank)
        first_dim_only = (dtype0 == dtype1 and len(shape0) == len(shape1) and len(shape0) > 0
                          and shape0[1:] == shape1[1:])
        text = (f". The ranks' inputs differ: {name} is {dtype0}{list(shape0)} on rank 0 but {dtype1}{list(shape1)} "
                f"on rank {rank}")
        if first_dim_only:
            text += (f" (rows per rank: {rows}). The torch.compile backend compiles one program for all ranks, so "
                     "it requires equal per-rank batch shapes (as DDP's averaging of the ranks' gradients assumes "
                     "equal per-rank batches): give every rank the same number of rows: a fixed batch size, "
                     "DataLoader(..., drop_last=True) with DistributedSampler(..., drop_last=True), or a global "
                     f"batch the number of ranks divides (here {total} rows over {world} ranks); adaptdist train "
                     "splits an uneven global batch itself")
        else:
            text += ("; the torch.compile backend compiles one program for all ranks, so every rank must pass "
                     "inputs of the same shapes and dtypes (pad or bucket them to fixed shapes)")
        return text
    return ""
