"""``python -m adaptdist.runtime.torchrun ARGS``: torchrun (``torch.distributed.run``: its parser, its ``run``,
torch's elastic agent) with one-line endings instead of tracebacks.

torchrun's ``main`` lets the agent's ``SignalException`` (it got SIGTERM/SIGINT and stopped its workers) and
``ChildFailedError`` (a worker failed past the restarts) end in a Python traceback and exit code 1. Here the
first exits 128 + signal (143, 130) and the second exits 1, each after one line on stderr naming the agent,
the rank and why. Everything else is torchrun's: the same flags, the same environment for the workers.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .launch import failure_reason

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except SignalException as e:
        from .. import _torch_compat as compat

        compat.stop_rendezvous_heartbeats()  # torch leaves it beating after a signal; the store may go first
        print(f"adaptdist: agent {os.getpid()} stopped its workers on {signal.Signals(e.sigval).name}",
              file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"adaptdist: agent {os.getpid()}: rank {rank} failed: {failure_reason(failure)} "
              f"(after {args.max_restarts} restart(s))", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
