"""Run a training script (or module) on one rank with bounded ``init_process_group`` defaults.

``python -m adaptdist.runtime.script_runner [--collective-timeout-s S] [--store-timeout-s S] SCRIPT [ARGS...]``
(or ``... -m MODULE [ARGS...]``) is what ``adaptdist launch`` and the elastic agents run on every rank, in
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). It runs the script as
``__main__`` (``runpy``, as ``python SCRIPT`` would: ``sys.argv`` is ``[SCRIPT, ARGS...]``, the script's folder
first on ``sys.path``) with :func:`init_defaults` in force:

* ``torch.distributed.init_process_group`` called without ``timeout=`` gets ``--collective-timeout-s``
  (torch's default is 30 minutes: a dead peer would hang the others that long);
* called for ``env://`` rendezvous (no ``store=``, no other ``init_method``) with ``MASTER_ADDR`` on loopback,
  rank 0 makes the store on a socket bound to 127.0.0.1 (torch's own would listen on every interface) and
  the others connect to it; in a multi-host job (``MASTER_ADDR`` is the address ``launch_hosts`` put in
  ``ADAPTDIST_BIND_ADDR``) rank 0 binds that address alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import runpy
import sys
from datetime import timedelta
from typing import Any, Iterator

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _env_store(timeout: timedelta) -> tuple[Any, int, int] | None:
    """(store, rank, world size) for an ``env://`` rendezvous on loopback, the store bound to 127.0.0.1; None
    when the environment is not that (the caller's init then goes its own way)."""
    import torch.distributed as dist

    from .sockets import BIND_ADDR_ENV, LOOPBACK, listen_socket

    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # the agent hosts it: torch's own way
    if addr in _LOOPBACK_HOSTS:
        addr = LOOPBACK
    elif BIND_ADDR_ENV not in os.environ or (rank == 0 and addr != os.environ[BIND_ADDR_ENV]):
        return None  # not a job of launch_hosts, or not an address we were told is ours: torch's own way
    if rank == 0:  # a multi-host job's rank 0 binds its host's address (launch_hosts sets BIND_ADDR_ENV)
        sock = listen_socket(addr, port)
        store = dist.TCPStore(addr, port, world_size=world, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(addr, port, world_size=world, is_master=False, timeout=timeout)
    return store, rank, world


@contextlib.contextmanager
def init_defaults(collective_s: float, store_s: float | None = None, loopback_store: bool = True
                  ) -> Iterator[None]:
    """Within: ``torch.distributed.init_process_group`` without ``timeout=`` uses ``collective_s`` seconds and,
    with ``loopback_store``, an ``env://`` init on loopback uses a store bound to 127.0.0.1 (timeout
    ``store_s``, default ``collective_s``). Explicit arguments are left as they are. The original function is
    put back on exit."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = dist.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        a = bound.arguments
        if a.get("timeout") is None:
            a["timeout"] = timedelta(seconds=collective_s)
        if (loopback_store and a.get("store") is None and a.get("init_method") in (None, "env://")
                and a.get("rank", -1) in (-1, None) and a.get("world_size", -1) in (-1, None)):
            found = _env_store(timedelta(seconds=store_s if store_s is not None else collective_s))
            if found is not None:
                a["store"], a["rank"], a["world_size"] = found
                a.pop("init_method", None)
        return original(*bound.args, **bound.kwargs)

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original
        c10d.init_process_group = original


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the elastic agent) dies, so a worker never
    outlives its agent (torch starts each worker in a session of its own, out of reach of a signal to the
    agent's group). Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(128 + int(signal.SIGKILL))


def _parser() -> argparse.ArgumentParser:
    from .timeouts import Timeouts

    p = argparse.ArgumentParser(prog="python -m adaptdist.runtime.script_runner",
                                description="run a script on one rank with bounded init_process_group defaults")
    from ..arg_types import positive

    p.add_argument("--collective-timeout-s", "--timeout-s", type=positive(float), default=Timeouts().collective_s,
                   help="timeout of init_process_group calls that set none, seconds")
    p.add_argument("--store-timeout-s", type=positive(float), default=None,
                   help="timeout of the workers' store, seconds (default: the collective timeout, as torch does)")
    p.add_argument("-m", dest="module", action="store_true", help="run a module (python -m) instead of a script")
    p.add_argument("target", help="the script (or, with -m, the module) to run")
    p.add_argument("target_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse the runner's arguments and run the script or module as ``__main__``."""
    args = _parser().parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by an agent
        die_with_parent()
    with init_defaults(args.collective_timeout_s, args.store_timeout_s):
        if args.module:
            sys.argv = [args.target, *args.target_args]
            runpy.run_module(args.target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [args.target, *args.target_args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(args.target)))
            runpy.run_path(args.target, run_name="__main__")


if __name__ == "__main__":
    main()
