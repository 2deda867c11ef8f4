"""Every global batch is checked against the batch the programs were compiled for, before it reaches them.

A program is compiled for one global batch shape: each rank takes its rows by a fixed slice and the loss's mean
divides by the compiled number of rows. A batch of another size would not fail but train wrongly (fewer rows:
the mean divided by the compiled count; more rows: the rows past the compiled count never seen), and another
sequence length fails deep inside a rank's program. So every batch, not only the first, is compared with the
compiled shapes and dtypes (shapes only: no data is read) and a mismatch raises :class:`~adaptdist.errors.DataError`
naming the step, the tensor, both shapes and what to do.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from ..errors import DataError

BatchShapes = tuple[tuple[tuple[int, ...], str], ...]
"""A global batch's signature: each tensor's (shape, dtype name without ``torch.``), in order."""


def batch_shapes(batch: Iterable[Any]) -> BatchShapes:
    """The :data:`BatchShapes` of ``batch`` (a tuple or list of tensors), e.g. the factory's example batch."""
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in batch)


def _describe(shape: tuple[int, ...], dtype: str) -> str:
    return f"{dtype} {list(shape)}"


def check_batch(batch: Any, expected: BatchShapes, source: str, step: int, compiled: str = "",
                sizes: str = "") -> None:
    """``batch`` (the global batch of 1-based ``step``) must have ``expected``'s count, shapes and dtypes.

    Args:
        source: where the batch came from, e.g. ``model.py:data``.
        compiled: what ``expected`` is, e.g. ``the factory's example batch``.
        sizes: the flags that set the shapes, e.g. ``--batch-size 6 --seq-len 128``.

    Raises:
        DataError: names the step, the tensor, the shapes expected and got, and what to do.
    """
    what = compiled or "the compiled batch"
    flags = f" at {sizes}" if sizes else ""
    if not isinstance(batch, (tuple, list)) or len(batch) != len(expected):
        n = len(batch) if hasattr(batch, "__len__") else "?"
        raise DataError(f"{source} yielded, for step {step}, a {type(batch).__name__} of {n} elements; {what}"
                        f"{flags} has {len(expected)} tensors: yield a tuple of {len(expected)} tensors every step")
    for i, (b, (shape, dtype)) in enumerate(zip(batch, expected)):
        if not hasattr(b, "shape") or not hasattr(b, "dtype"):
            raise DataError(f"{source} yielded, for step {step}, batch element {i} as {type(b).__name__}; {what}"
                            f"{flags} has a tensor {_describe(shape, dtype)} there: yield tensors")
        got_shape, got_dtype = tuple(b.shape), str(b.dtype).removeprefix("torch.")
        if got_shape == tuple(shape) and got_dtype == dtype:
            continue
        if got_dtype != dtype:
            todo = f"convert it to {dtype} (e.g. .to(torch.{dtype}))"
        elif len(got_shape) == len(shape) and got_shape[0] != shape[0] and got_shape[1:] == tuple(shape[1:]):
            todo = (f"every batch must have {shape[0]} rows (--batch-size): a smaller one would train on a wrong "
                    f"mean (divided by {shape[0]}), a larger one on its first {shape[0]} rows only; yield batches of "
                    "a fixed size: drop the last partial batch (e.g. DataLoader(drop_last=True)) or fill it up")
        else:
            todo = ("every batch must have the compiled shape: pad or cut sequences to the compiled length "
                    "(--seq-len), or compile for the shape the data has")
        raise DataError(f"{source} yielded, for step {step}, batch element {i} as {_describe(got_shape, got_dtype)}, "
                        f"but the programs were compiled for {_describe(shape, dtype)} ({what}{flags}); {todo}")


def checked_batches(batches: Iterator[Any], expected: BatchShapes | None, source: str, first_step: int = 1,
                    compiled: str = "", sizes: str = "") -> Iterator[Any]:
    """``batches`` (those of 1-based steps ``first_step``, ``first_step + 1``, ...) each checked by
    :func:`check_batch` as it is drawn. With ``expected`` None, against the first batch drawn (``step N's batch``).

    Raises:
        DataError: from :func:`check_batch`, when the offending batch is drawn.
    """
    step = first_step
    for batch in batches:
        if expected is None:
            expected = batch_shapes(batch) if isinstance(batch, (tuple, list)) and all(
                hasattr(t, "shape") for t in batch) else None
            compiled = compiled or f"the batch of step {step}"
        if expected is not None:
            check_batch(batch, expected, source, step, compiled, sizes)
        yield batch
        step += 1
