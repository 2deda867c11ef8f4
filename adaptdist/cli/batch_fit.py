"""Which batch does not fit the model, when a model file's ``data()`` and its factory's example batch differ.

``adaptdist train FILE.py:FACTORY`` compiles for the factory's example batch and checks ``data()``'s first batch
against it (:func:`adaptdist.cli.common.check_batch`). When they differ, either may be the wrong one: a factory
whose example batch has 7 features for a model that takes 8 (and a ``data()`` that yields 8) used to be reported
as bad data. :func:`blame` runs the step (``loss_fn(model(*batch[:-1]), batch[-1])``, no gradient) on each
batch and names the function whose batch the model does not take, with the shapes and the model's error.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import DataError, UsageError


def shapes_text(batch: Any) -> str:
    """``[float32 [16, 7], int64 [16]]``: each element's dtype and shape."""
    return "[" + ", ".join(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}" if hasattr(t, "shape")
                           else type(t).__name__ for t in batch) + "]"


def step_error(model: Any, loss_fn: Callable, batch: Any) -> str:
    """What running the step on ``batch`` raised (``Type: first line``), or "" when it runs. No gradient is taken;
    the model's buffers (BatchNorm's running statistics) and the random generator's state are restored after."""
    import torch

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            loss_fn(model(*batch[:-1]), batch[-1])
        return ""
    except Exception as e:  # the model's own error on this batch: what the message reports
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        torch.set_rng_state(rng)


def blame(error: DataError, batch: Any, example: Any, model: Any, loss_fn: Callable, factory: str,
          source: str) -> Exception:
    """The error to raise for ``error`` (``source``'s ``batch`` differs from the ``factory``'s ``example``): a
    UsageError naming the factory when the model does not take its example batch (whether or not it takes
    ``batch``), else ``error`` itself, told when the model does not take ``batch`` either."""
    example_error = step_error(model, loss_fn, example)
    data_error = step_error(model, loss_fn, batch)
    if example_error:
        fits = ("which the model takes" if not data_error else
                f"which the model does not take either ({data_error})")
        return UsageError(
            f"the example batch of {factory} does not fit the model: the step on it, loss_fn(model(*batch[:-1]), "
            f"batch[-1]), raised {example_error}; the example batch is {shapes_text(example)}, {source} yields "
            f"{shapes_text(batch)}, {fits}. adaptdist compiles for the factory's example batch: make the factory "
            f"return an example batch of the shapes and dtypes {source} yields (and the model takes)")
    if data_error:
        return DataError(f"{error} (the model takes the example batch of {factory} but not {source}'s: {data_error})")
    return error
