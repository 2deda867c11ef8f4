"""What several commands share: turning ``--plan`` into a plan object."""

from __future__ import annotations


def resolve_plan(args, spec, model, example, loss_fn, cluster, console, optimizer: str, layers: bool = True):
    """``--plan`` as a plan object, and the captured step when the planner captured it (else None):
    ``auto`` runs the planner for ``cluster`` (printing its summary), anything else is a manual plan."""
    from ..annotations import ManualPlan

    if args.plan != "auto":
        return ManualPlan.parse(args.plan, spec.module()), None
    from ..compiler.capture import capture
    from ..compiler.planner.summary import print_summary, run_planner

    captured = capture(model, example, loss_fn)
    result = run_planner(captured, cluster, args.mesh, optimizer, console,
                         replicate_fallback=bool(getattr(args, "replicate_fallback", False)))
    print_summary(console, result, layers=layers)
    return result.plan, captured



MAX_SEED = 2**63 - 1
"""The largest ``--seed``: a rank seeds torch with ``seed + rank`` (``torch.manual_seed`` takes up to 2**64 - 1)."""


def positive(kind):
    """An argparse ``type=`` for a number > 0 of ``kind`` (int or float); floats must also be finite (``nan`` and
    ``inf`` are refused: ``--lr nan`` would only fail on the ranks, ``--max-grad-norm nan`` would turn clipping
    off). argparse prefixes the message with the flag (``argument --lr: ...``)."""
    import argparse
    import math

    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v
    conv.__name__ = f"positive {kind.__name__}"
    return conv


def seed(text: str) -> int:
    """An argparse ``type=`` for ``--seed``: an integer in 0..:data:`MAX_SEED`."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..2**63-1 ({MAX_SEED}), got {text}")
    return v


def prepare_out_dir(path: str, flag: str = "--out"):
    """Create the output directory ``path`` (and its parents) before any work; returns it as a Path.

    Raises:
        UsageError: ``path`` exists and is not a directory, or cannot be created (permissions, a read-only or
            virtual file system such as /proc); the message names ``flag``.
    """
    from pathlib import Path

    from ..errors import UsageError

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {str(out)!r} exists and is not a directory; pass a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the output directory {flag} {str(out)!r}: {e.strerror or e}; pass a "
                         "writable directory path") from None
    return out
