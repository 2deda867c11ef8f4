"""``adaptdist launch [--nproc N] script.py [args...]``: run a training script on N local ranks.

The script is started the way ``torchrun --standalone --nproc-per-node N`` starts it (torch's own launcher,
``torch.distributed.run``: each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``), so a script written for torchrun, e.g. one that uses ``torch.compile(model,
backend="adaptdist")``, runs unchanged.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import RuntimeLaunchError, UsageError


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``adaptdist launch``."""
    p = sub.add_parser("launch", help="run a training script on local ranks (as torchrun does)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) on this machine")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the script on ``--nproc`` local ranks; returns 0, or raises if a rank failed.

    Raises:
        UsageError: the script does not exist or ``--nproc`` is not positive.
        RuntimeLaunchError: a rank exited with an error (torch's launcher printed its traceback).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if not Path(args.script).is_file():
        raise UsageError(f"adaptdist launch: no such script {args.script!r}")
    if args.nproc < 1:
        raise UsageError(f"adaptdist launch: --nproc must be at least 1, got {args.nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    torchrun_args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(args.nproc), args.script, *args.script_args])
    try:
        run(torchrun_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RuntimeLaunchError(rank_failure_message(args.script, rank, failure.exitcode)) from None
    return 0


def rank_failure_message(script: str, rank: int, exitcode: int) -> str:
    """What ``adaptdist launch`` says when ``rank`` of ``script`` failed with ``exitcode`` (torch's launcher's:
    negative when a signal killed the process). A killed rank printed no traceback (one printed above is another
    rank's, e.g. a peer's "Connection reset"), so only an exception exit points at the traceback."""
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        hint = ("; SIGKILL often comes from the out-of-memory killer (see dmesg) or an outside kill"
                if name == "SIGKILL" else "")
        return (f"{script} failed on rank {rank}: killed by signal {-exitcode} ({name}), so it printed no traceback "
                f"(any traceback above is another rank's, failing after it){hint}")
    return f"{script} failed on rank {rank} (exit code {exitcode}); its traceback is printed above"
