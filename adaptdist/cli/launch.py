"""``adaptdist launch [--nproc N] script.py [args...]``: run a training script on N local ranks.

The script is started the way ``torchrun --standalone --nproc-per-node N`` starts it (torch's own launcher,
``torch.distributed.run``: each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``), so a script written for torchrun, e.g. one that uses ``torch.compile(model,
backend="adaptdist")``, runs unchanged.

Unlike plain torchrun: each rank runs the script through :mod:`adaptdist.runtime.script_runner`, so an
``init_process_group`` without ``timeout=`` gets ``--collective-timeout-s`` (torch's default, 30 minutes, is how
long the others would hang on a dead rank); every store listens on 127.0.0.1 only; ``--max-restarts R`` restarts
all ranks when one fails (torchrun's); SIGTERM/Ctrl-C is passed on to the ranks, and ends in one line and exit
code 143/130.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import RuntimeLaunchError, UsageError
from .common import local_ranks, nonnegative_int, positive


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``adaptdist launch``."""
    p = sub.add_parser("launch", help="run a training script on local ranks (as torchrun does)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from ..runtime.timeouts import Timeouts

    p.add_argument("--nproc", type=local_ranks, default=2, help="ranks (processes) on this machine")
    p.add_argument("--collective-timeout-s", "--timeout-s", dest="collective_timeout_s", type=positive(float),
                   default=Timeouts().collective_s,
                   help="timeout of the script's init_process_group (and so of its collectives) when it sets "
                        "none, seconds")
    p.add_argument("--max-restarts", type=nonnegative_int, default=0,
                   help="restart every rank this many times at most when one fails (torchrun's --max-restarts)")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the script on ``--nproc`` local ranks; returns 0, or 143/130 when SIGTERM/SIGINT stopped it (one line
    printed), or raises if a rank failed.

    Raises:
        UsageError: the script does not exist, ``--nproc`` is not positive, ``--max-restarts`` is negative or
            ``--collective-timeout-s`` is not positive.
        RuntimeLaunchError: a rank failed after the last allowed restart (torch's launcher printed its traceback).
    """
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from ..runtime.launch import LOOPBACK, host_loopback_store, local_run
    from ..runtime.timeouts import Timeouts

    if not Path(args.script).is_file():
        raise UsageError(f"adaptdist launch: no such script {args.script!r}")
    if args.nproc < 1:
        raise UsageError(f"adaptdist launch: --nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise UsageError(f"adaptdist launch: --max-restarts must be at least 0, got {args.max_restarts}")
    if not args.collective_timeout_s > 0:
        raise UsageError(f"adaptdist launch: --collective-timeout-s must be positive, got {args.collective_timeout_s}")
    timeouts = Timeouts().with_collective(args.collective_timeout_s)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    store = host_loopback_store(0, timeouts.store_s)  # the rendezvous store, here, on loopback only
    torchrun_args = get_args_parser().parse_args([
        "--nnodes", "1:1", "--nproc-per-node", str(args.nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{store.port}",
        "--rdzv-id", f"adaptdist-launch-{os.getpid()}", "--rdzv-conf", timeouts.rdzv_conf_arg(is_host=False),
        "--local-addr", LOOPBACK, "--max-restarts", str(args.max_restarts),
        "--shutdown-timeout", str(int(max(1, round(timeouts.shutdown_grace_s)))),
        "-m", "adaptdist.runtime.script_runner", "--collective-timeout-s", str(timeouts.collective_s),
        args.script, *args.script_args])
    try:
        with local_run():
            run(torchrun_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RuntimeLaunchError(rank_failure_message(args.script, rank, failure.exitcode,
                                                      restarts=args.max_restarts)) from None
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"adaptdist: {args.script} interrupted by {name} (passed on to its {args.nproc} ranks)",
              file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        del store
    return 0


def rank_failure_message(script: str, rank: int, exitcode: int, restarts: int = 0) -> str:
    """What ``adaptdist launch`` says when ``rank`` of ``script`` failed with ``exitcode`` (torch's launcher's:
    negative when a signal killed the process) after ``restarts`` restarts. A killed rank printed no traceback
    (one printed above is another rank's, e.g. a peer's "Connection reset"), so only an exception exit points at
    the traceback."""
    from ..runtime.launch import describe_exit

    after = f" after {restarts} restart(s)" if restarts else ""
    if exitcode is not None and exitcode < 0:
        why = describe_exit(exitcode)
        reason, _, hint = why.partition("; ")
        return (f"{script} failed on rank {rank}{after}: {reason}, so it printed no traceback "
                f"(any traceback above is another rank's, failing after it){'; ' + hint if hint else ''}")
    return f"{script} failed on rank {rank}{after} (exit code {exitcode}); its traceback is printed above"
