"""Launch local ranks through torch's elastic agent (what torchrun uses), with restarts and elasticity.

Two forms:

* :func:`launch_local`: one agent in this process starts ``nproc`` workers running a function; when one
  dies (a signal, an exception, a nonzero exit) the agent stops the others and restarts them all, up to
  ``max_restarts`` times.
* :func:`launch_elastic_local`: ``--nproc MIN:MAX``: one torchrun agent (a subprocess) per rank, all
  meeting in a c10d rendezvous whose store this process hosts, so any agent may die (a rank leaves) or be
  added later (a rank joins) and the rest re-form at the new world size, torchrun's semantics.

Every store of a local run listens on 127.0.0.1 only: torch's ``TCPStore`` server binds every interface
whatever host it is given, so the stores are made here on a socket bound to loopback
(``TCPStore(master_listen_fd=...)``): the rendezvous store in the launcher (the agents join it with
``is_host=false``), and the workers' store by worker rank 0 (:mod:`adaptdist.runtime.script_runner`'s
``init_process_group`` defaults; torch's agent-hosted worker store, which binds every interface, is turned
off with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Gloo's own sockets are kept on ``lo``
(``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import RunInterruptedError, RuntimeLaunchError, UsageError
from .timeouts import Timeouts

from .sockets import BIND_ADDR_ENV, LOOPBACK, listen_socket, loopback_listen_socket  # noqa: F401  (re-exported)

LOCAL_RUN_ENV = MappingProxyType({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"})
"""Environment of a local run (set unless already set): workers' store made by rank 0 (on loopback, see the
module docstring), gloo on the loopback interface."""

_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torch's agent installs handlers for these


def restart_count() -> int:
    """Which attempt this worker is: 0 for the first start, n after the agent's n-th restart of it
    (``TORCHELASTIC_RESTART_COUNT``, which torch's agent sets; 0 outside an agent). Membership changes of an
    elastic run (a rank joining) restart the workers without counting."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def host_loopback_store(port: int = 0, timeout_s: float = 300.0) -> Any:
    """A ``TCPStore`` server listening on 127.0.0.1:``port`` only (0: a free port; ``store.port`` says which).

    Raises:
        RuntimeLaunchError: the port is taken.
    """
    return host_store(LOOPBACK, port, timeout_s)


def host_store(addr: str, port: int = 0, timeout_s: float = 300.0) -> Any:
    """A ``TCPStore`` server listening on ``addr``:``port`` only (torch's own binds every interface).

    Raises:
        RuntimeLaunchError: the port is taken, or ``addr`` is no address of this host.
    """
    try:
        sock = listen_socket(addr, port)
    except OSError as e:
        raise RuntimeLaunchError(f"cannot listen on {addr}:{port} for the store: {e}") from None
    return _store_on(sock, timeout_s)


def _store_on(sock: socket.socket, timeout_s: float) -> Any:
    """A ``TCPStore`` server on the listening ``sock`` (the store takes the descriptor over and closes it when
    it is destroyed)."""
    import torch.distributed as dist

    addr, port = sock.getsockname()[:2]
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


@contextlib.contextmanager
def _env(values: Mapping[str, str], *, override: bool = False) -> Iterator[None]:
    """Within: ``os.environ`` holds ``values`` (only those not already set, unless ``override``)."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if override or k not in os.environ:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """Torch's agent installs handlers for SIGTERM/SIGINT/SIGHUP/SIGQUIT in its process and leaves them; put
    this process's own back afterwards (Ctrl-C raises KeyboardInterrupt again)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(getattr(signal, s)) for s in _HANDLED_SIGNALS if hasattr(signal, s)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, s), handler)


@contextlib.contextmanager
def local_run() -> Iterator[None]:
    """Within: the environment of a local run (:data:`LOCAL_RUN_ENV`, where not already set) and, on exit, this
    process's own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers back (torch's agent replaces them and leaves its own).
    Wrap a call of torch's ``elastic_launch`` / ``torch.distributed.run.run`` in it."""
    with _env(LOCAL_RUN_ENV), _kept_signal_handlers():
        yield


def describe_exit(exitcode: int | None) -> str:
    """Why a worker ended, in words: ``killed by signal 9 (SIGKILL)`` with the out-of-memory hint,
    ``stopped on SIGTERM (exit code 143)``, or ``exit code N``. ``exitcode`` is torch's launcher's: negative
    when a signal killed the process."""
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        hint = ("; SIGKILL often comes from the out-of-memory killer (see dmesg) or an outside kill"
                if name == "SIGKILL" else "")
        return f"killed by signal {-exitcode} ({name}){hint}"
    signum = interrupt_signal(exitcode)
    if signum is not None:
        return f"stopped on {signal.Signals(signum).name} (exit code {exitcode})"
    return f"exit code {exitcode}"


def interrupt_signal(exitcode: int | None) -> int | None:
    """SIGTERM or SIGINT when ``exitcode`` says a worker stopped on it (128 + signal, as a graceful stop exits,
    or killed by it), else None."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if exitcode in (128 + sig, -sig):
            return int(sig)
    return None


def failure_reason(failure: Any) -> str:
    """Why a worker failed, from torch's ``ProcessFailure``: its exception's ``Type: message`` when it wrote an
    error file, else :func:`describe_exit` of its exit code."""
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", str(msg))
    msg = str(msg).strip()
    if failure.exitcode is not None and failure.exitcode < 0 or not msg or msg.startswith("To enable traceback"):
        return describe_exit(failure.exitcode)
    return msg


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
              "Socket Timeout", "Connection refused", "DistNetworkError", "DistStoreError", "adaptdist shm:")
"""Fragments of the errors a worker raises because a PEER failed (it is not the root cause); ``adaptdist shm:``
starts every error of a shared-memory collective whose peer died or stalled (``adaptdist.kernels.shm``)."""


@dataclass(frozen=True)
class _Failure:
    rank: int
    reason: str
    time_s: float

    @property
    def consequence(self) -> bool:
        return any(frag in self.reason for frag in _PEER_LOSS)


def _root_failure(failures: dict[int, Any], reports: dict[int, tuple[str, float]]) -> _Failure:
    """The failure that most likely caused the others: a worker killed by a signal or failing on its own (not
    on a lost peer: "Connection closed by peer", a timeout), the earliest first. ``reports`` are the workers'
    own reports of their exceptions (rank -> (message, time)): torch's agent records only the workers it saw
    exit before it stopped the rest, and its error-file times have a one-second resolution, so the rank it
    names first is often a peer's consequence."""
    found: dict[int, _Failure] = {}
    for rank, f in failures.items():
        found[rank] = _Failure(rank, failure_reason(f), float(f.timestamp))
    for rank, (message, time_s) in reports.items():
        killed = rank in found and failures[rank].exitcode is not None and failures[rank].exitcode < 0 \
            and not failures[rank].error_file_data.get("message")
        if not killed:  # a report is the exception itself; a kill after it (the abort at exit) says less
            found[rank] = _Failure(rank, message, time_s)
    return min(found.values(), key=lambda f: (f.consequence, f.time_s, f.rank))


def _read_reports(report_dir: str | None) -> dict[int, tuple[str, float]]:
    """The failure reports of the last attempt in ``report_dir`` (see :func:`_worker_main`)."""
    if report_dir is None or not os.path.isdir(report_dir):
        return {}
    rows = []
    for name in os.listdir(report_dir):
        try:
            rank_s, attempt_s, _ = name.split(".", 2)
            with open(os.path.join(report_dir, name)) as f:
                time_s, message = f.read().split("\n", 1)
            rows.append((int(attempt_s), int(rank_s), message.strip(), float(time_s)))
        except (OSError, ValueError):
            continue
    if not rows:
        return {}
    last = max(r[0] for r in rows)
    return {rank: (message, time_s) for attempt, rank, message, time_s in rows if attempt == last}


def _child_failure_error(e: Any, max_restarts: int, report_dir: str | None = None,
                         restart_advice: str = "--max-restarts raises the limit") -> RuntimeLaunchError:
    """A ChildFailedError of torch's agent as our error: RunInterruptedError when every failed worker stopped
    on the same SIGTERM/SIGINT, else RuntimeLaunchError naming the root failure's rank, why and the restarts."""
    failures = e.failures
    signals = {interrupt_signal(f.exitcode) for f in failures.values()}
    if len(signals) == 1 and None not in signals:
        signum = signals.pop()
        return RunInterruptedError(
            f"rank(s) {', '.join(map(str, sorted(failures)))} stopped on {signal.Signals(signum).name}", signum)
    reports = _read_reports(report_dir)
    root = _root_failure(failures, reports)
    restarts = f"after {max_restarts} restart(s), all allowed" if max_restarts else "no restarts allowed"
    # every rank that reported the same error (a DataError each rank's loader raises alike) is named once here:
    # the workers no longer print the errors they report (:func:`_worker_main`)
    same = sorted({root.rank} | {r for r, (message, _) in reports.items() if message == root.reason})
    who = f"rank {root.rank}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
    others: dict[str, list[int]] = {}  # other errors of their own (not a lost peer), which no worker printed
    for r, (message, _) in sorted(reports.items()):
        if r not in same and not _Failure(r, message, 0.0).consequence:
            others.setdefault(message, []).append(r)
    also = "".join(f"; rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} also failed: {m}"
                   for m, rs in others.items())
    return RuntimeLaunchError(f"{who} failed: {root.reason}{also} ({restarts}; {restart_advice})")


FINISHED_AFTER_STOP_EXIT_S = 3.0
"""A worker that finished its function after a stop signal exits this long after returning (see
:func:`_exit_unless_collected`)."""


def _exit_unless_collected(after_s: float) -> None:
    """End this worker process ``after_s`` seconds from now (exit 0) unless it ended before. For a worker that
    finished after a stop signal (``run_worker`` trains its last step, then writes everything): its launcher got
    the signal too (Ctrl-C reaches the whole group) and is shutting down, so torch's agent never tells the worker
    that its return value was read (the worker waits for that after putting it) and would SIGKILL it only after its
    whole grace period; a launcher that is not shutting down reads the value within its monitor interval."""
    import threading

    def later() -> None:
        time.sleep(after_s)
        os._exit(0)

    threading.Thread(target=later, name="adaptdist-exit-after-stop", daemon=True).start()


def _worker_main(fn: Callable[..., Any], args: tuple, collective_s: float, store_s: float | None,
                 report_dir: str | None = None, max_restarts: int = 0) -> Any:
    """What each worker of :func:`launch_local` runs: ``fn(*args)`` under our ``init_process_group`` defaults.
    An exception is first reported to ``report_dir/RANK.ATTEMPT.txt`` (time, then ``Type: message``), before
    the process group is destroyed (which its peers notice at once). An adaptdist error is printed as one line
    (``rank N: Type: message``) only where the launcher will not: no report written, or an attempt that
    ``max_restarts`` restarts again (the launcher reports the last attempt's errors only); else each rank
    and then the launcher would print the same message."""
    from .script_runner import die_with_parent, init_defaults

    die_with_parent()
    import torch.distributed as dist

    with init_defaults(collective_s=collective_s, store_s=store_s):
        try:
            ret = fn(*args)
            if isinstance(ret, dict) and ret.get("stop_signal"):  # finished although a stop signal came
                _exit_unless_collected(FINISHED_AFTER_STOP_EXIT_S)
            return ret
        except BaseException as e:
            code = e.code if isinstance(e, SystemExit) else None
            reported = False
            if report_dir is not None and (not isinstance(e, SystemExit) or (isinstance(code, int) and code)):
                # an exit with a code is a failure of its own too (torch's agent may record only the peer that
                # lost its connection to it)
                text = f"exit code {code}" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
                name = os.path.join(report_dir, f"{os.environ.get('RANK', 0)}.{restart_count()}.txt")
                with contextlib.suppress(OSError), open(name, "w") as f:
                    f.write(f"{time.time()!r}\n{text}".strip())
                    reported = restart_count() >= max_restarts  # the last attempt: the launcher prints it
            # an undestroyed gloo group's threads abort the exit (SIGABRT), hiding why this rank failed
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            from ..errors import AdaptdistError

            if isinstance(e, AdaptdistError):  # a user-facing error: one line (reported above), not a traceback
                if not reported:
                    print(f"rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            raise


def _launch_config(min_nodes: int, max_nodes: int, nproc_per_node: int, run_id: str, endpoint: str,
                   local_addr: str, max_restarts: int, timeouts: Timeouts, monitor_interval_s: float) -> Any:
    """torch's LaunchConfig of our launches: c10d rendezvous at ``endpoint`` whose store we host ourselves
    (``is_host: False``), spawned workers, ``timeouts``' rendezvous settings and shutdown grace."""
    from .. import _torch_compat as compat

    return compat.elastic_launch_config(
        timeouts.shutdown_grace_s, min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
        run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={**timeouts.rdzv_configs(), "is_host": False}, max_restarts=max_restarts,
        monitor_interval=monitor_interval_s, start_method="spawn", local_addr=local_addr)


def launch_local(fn: Callable[..., Any], args: tuple, nproc: int, *, max_restarts: int = 0,
                 timeouts: Timeouts = Timeouts(), monitor_interval_s: float = 0.1,
                 restart_advice: str = "--max-restarts raises the limit") -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local processes under torch's elastic agent; returns {rank: return value
    of the last attempt}.

    Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (127.0.0.1)/``MASTER_PORT`` and
    ``TORCHELASTIC_RESTART_COUNT`` (:func:`restart_count`). ``torch.distributed.init_process_group`` called
    there without ``timeout=`` gets ``timeouts.collective_s``. When a worker dies (a signal such as SIGKILL,
    an exception, a nonzero exit) the agent stops the others (SIGTERM, then SIGKILL after 30 s) and starts
    them all again, at most ``max_restarts`` times; ``fn`` resumes from its own checkpoint. A SIGTERM/SIGINT
    to this process is passed to the workers, which get ``timeouts.shutdown_grace_s`` seconds to exit before
    SIGKILL. All stores listen on 127.0.0.1 only.

    Raises:
        UsageError: ``nproc`` < 1 or ``max_restarts`` < 0.
        RunInterruptedError: every failed worker stopped on SIGTERM/SIGINT (a graceful stop, exit 143/130).
        RuntimeLaunchError: a worker failed after the last allowed restart; the message names its rank, why
            (the signal, e.g. SIGKILL with the out-of-memory hint, or the exception's message) and the
            restarts used.
        RunInterruptedError: this process got SIGTERM/SIGINT/SIGHUP/SIGQUIT; the agent sent it on to the
            workers and waited for them (``timeouts.shutdown_grace_s``, then SIGKILL).
            :func:`adaptdist.runtime.stop.interrupted_exit_code` gives the exit code (143, 130).
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if nproc < 1:
        raise UsageError(f"nproc must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise UsageError(f"max_restarts must be at least 0, got {max_restarts}")
    timeouts.check()
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # we report failures ourselves
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import tempfile

    store = host_loopback_store(0, timeouts.store_s)
    report_dir = tempfile.mkdtemp(prefix="adaptdist-launch-")
    config = _launch_config(1, 1, nproc, f"adaptdist-{uuid.uuid4().hex[:8]}", f"{LOOPBACK}:{store.port}", LOOPBACK,
                            max_restarts, timeouts, monitor_interval_s)
    try:
        with local_run():
            return elastic_launch(config, _worker_main)(fn, args, timeouts.collective_s, None, report_dir,
                                                        max_restarts)
    except ChildFailedError as e:
        raise _child_failure_error(e, max_restarts, report_dir, restart_advice) from None
    except SignalException as e:
        raise RunInterruptedError(
            f"the launcher got {signal.Signals(e.sigval).name}: it was sent on to the {nproc} workers, given "
            f"{config.shutdown_timeout} s to stop", int(e.sigval)) from None
    finally:
        import shutil

        from .. import _torch_compat as compat

        compat.stop_rendezvous_heartbeats()  # left beating after a SignalException; the store goes next
        shutil.rmtree(report_dir, ignore_errors=True)
        del store


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now (not reserved: bind it soon)."""
    with contextlib.closing(loopback_listen_socket(0)) as sock:
        return sock.getsockname()[1]


@dataclass
class ElasticLocalJob:
    """A running ``--nproc MIN:MAX`` job (:func:`launch_elastic_local`): one torchrun agent per rank, each a
    subprocess in its own process group, meeting at the rendezvous store this process hosts.

    Use as a context manager (or call :meth:`close`): leaving it kills every agent's process group that is
    still running, so no agent or worker outlives the job.
    """

    command: list[str]
    env: dict[str, str]
    store: Any
    endpoint: str
    timeouts: Timeouts = Timeouts()
    nodes: list[subprocess.Popen] = field(default_factory=list)
    stdout: Any = None
    stderr: Any = None

    @property
    def pids(self) -> list[int]:
        """The agents' PIDs, in the order they were started (node index)."""
        return [p.pid for p in self.nodes]

    def add_node(self) -> int:
        """Start one more agent (scale up: it joins at the next rendezvous round, the running agents restart
        their workers to take it in); returns its node index."""
        proc = subprocess.Popen(self.command, env=self.env, start_new_session=True,
                                stdout=self.stdout, stderr=self.stderr)
        self.nodes.append(proc)
        return len(self.nodes) - 1

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to agent ``i`` and its workers (a lost machine with SIGKILL, a preemption with SIGTERM):
        to the agent's process group and to each worker's (torch's agent starts every worker in a session of
        its own). Raises UsageError for an unknown index."""
        if not 0 <= i < len(self.nodes):
            raise UsageError(f"no node {i}: the job has nodes 0..{len(self.nodes) - 1}")
        _kill_tree(self.nodes[i].pid, sig)

    def poll(self) -> list[int | None]:
        """Each agent's exit code (None while it runs)."""
        return [p.poll() for p in self.nodes]

    def wait(self, timeout_s: float) -> int:
        """Wait until every agent has exited; returns 0 when all exited 0 or were killed by
        :meth:`kill_node`, else the first other nonzero exit code.

        Raises:
            RuntimeLaunchError: agents still run after ``timeout_s`` seconds (they are left running: call
                :meth:`close`).
        """
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.nodes):
            if time.monotonic() > deadline:
                running = [i for i, p in enumerate(self.nodes) if p.poll() is None]
                raise RuntimeLaunchError(f"elastic job: agents {running} still running after {timeout_s:g} s")
            time.sleep(0.1)
        codes = [p.returncode for p in self.nodes]
        return next((c for c in codes if c not in (0, -signal.SIGKILL)), 0)

    def stop(self, sig: int = signal.SIGTERM) -> list[int | None]:
        """Pass ``sig`` (SIGTERM: a preemption; SIGINT: Ctrl-C, which reaches only this process as the agents
        run in sessions of their own) to every agent, which passes it to its worker and waits
        ``timeouts.shutdown_grace_s`` before SIGKILL; then wait for the agents (that long plus 10 s) and
        :meth:`close`. Returns the agents' exit codes (143/130 for an agent that stopped on the signal)."""
        live = [p for p in self.nodes if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)  # the agent alone: it forwards the signal and waits for its worker
        deadline = time.monotonic() + self.timeouts.shutdown_grace_s + 10.0
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        codes = self.poll()
        self.close()
        return codes

    def close(self, grace_s: float | None = None) -> None:
        """Stop every agent still running: SIGTERM to it and its worker, SIGKILL after ``grace_s`` seconds
        (default ``timeouts.shutdown_grace_s``); then reap them. Idempotent."""
        grace_s = self.timeouts.shutdown_grace_s if grace_s is None else grace_s
        live = [p for p in self.nodes if p.poll() is None]
        trees = {p.pid: _descendants(p.pid) for p in self.nodes}
        for p in live:
            _kill_tree(p.pid, signal.SIGTERM, trees[p.pid])
        deadline = time.monotonic() + grace_s
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in self.nodes:
            # a group outlives its leader while a member lives: kill the groups in any case
            _kill_tree(p.pid, signal.SIGKILL, trees[p.pid] | _descendants(p.pid))
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)

    def __enter__(self) -> "ElasticLocalJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _descendants(pid: int) -> set[int]:
    """The PIDs of ``pid``'s living descendants (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        if child not in out:
            out.add(child)
            todo.extend(children.get(child, ()))
    return out


def _kill_tree(pid: int, sig: int, descendants: set[int] | None = None) -> None:
    """``sig`` to ``pid``'s process group and to the group of each of its descendants (read before the
    signal: a killed agent's workers are orphaned at once)."""
    descendants = _descendants(pid) if descendants is None else descendants
    for target in (pid, *sorted(descendants)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(target, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)


def launch_elastic_local(entry_module: str, entry_args: Sequence[str], min_nodes: int, max_nodes: int, *,
                         max_restarts: int, timeouts: Timeouts = Timeouts(), env: dict[str, str] | None = None,
                         nodes: int | None = None, monitor_interval_s: float = 0.1,
                         stdout: Any = None, stderr: Any = None) -> ElasticLocalJob:
    """Start an elastic local job: ``nodes`` (default ``max_nodes``) torchrun agents, one per rank, running
    ``python -m entry_module entry_args`` (through :mod:`adaptdist.runtime.script_runner`, so
    ``init_process_group`` gets ``timeouts.collective_s`` and a loopback store); returns the running job.

    Each agent is torchrun, ``python -m adaptdist.runtime.torchrun --nnodes MIN:MAX --nproc-per-node 1
    --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf is_host=false,... --max-restarts R ...``
    (torch's ``torch.distributed.run`` with one-line endings and exit codes 143/130 on SIGTERM/SIGINT, see
    :mod:`adaptdist.runtime.torchrun`), in a session of its own; the rendezvous store
    lives in this process, so killing any agent leaves the others able to re-form: a killed agent is dropped
    after ``timeouts.keep_alive_expiry_s`` and the survivors start again at the smaller world size once the
    rendezvous's last call (``timeouts.rendezvous_last_call_s``) has passed. A failure costs each surviving
    agent one of its ``max_restarts``; a node joining costs none. ``env`` adds to this process's environment;
    ``stdout``/``stderr`` are passed to ``subprocess.Popen`` (None: inherited).

    Raises:
        UsageError: not ``1 <= min_nodes <= max_nodes``, ``nodes`` outside that range, ``max_restarts`` < 0.
    """
    if not 1 <= min_nodes <= max_nodes:
        raise UsageError(f"--nproc MIN:MAX needs 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
    nodes = max_nodes if nodes is None else nodes
    if not min_nodes <= nodes <= max_nodes:
        raise UsageError(f"nodes={nodes} must lie in {min_nodes}..{max_nodes}")
    if max_restarts < 0:
        raise UsageError(f"max_restarts must be at least 0, got {max_restarts}")
    from .. import _torch_compat as compat

    timeouts.check()
    store = host_loopback_store(0, timeouts.store_s)
    endpoint = f"{LOOPBACK}:{store.port}"
    command = [
        sys.executable, "-m", "adaptdist.runtime.torchrun",
        "--nnodes", f"{min_nodes}:{max_nodes}", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"adaptdist-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf", timeouts.rdzv_conf_arg(is_host=False),
        "--max-restarts", str(max_restarts), "--monitor-interval", str(monitor_interval_s),
        "--local-addr", LOOPBACK, *compat.torchrun_shutdown_timeout_args(timeouts.shutdown_grace_s),
        "-m", "adaptdist.runtime.script_runner", "--collective-timeout-s", str(timeouts.collective_s),
        "-m", entry_module, *entry_args,
    ]
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    for k, v in LOCAL_RUN_ENV.items():
        child_env.setdefault(k, v)
    job = ElasticLocalJob(command=command, env=child_env, store=store, endpoint=endpoint, timeouts=timeouts,
                          stdout=stdout, stderr=stderr)
    try:
        for _ in range(nodes):
            job.add_node()
    except BaseException:
        job.close()
        raise
    return job


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port).

    Raises:
        UsageError: no port, or a port outside 1..65535.
    """
    host, sep, port_s = endpoint.rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 0 < port < 65536:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29400 (the address of "
                         "the host that holds the rendezvous store, and a free port there)")
    return host.strip("[]"), port


def route_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (the source address the kernel picks for it; no packet is
    sent).

    Raises:
        UsageError: ``host`` does not resolve or no route leads to it.
    """
    try:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError as e:
        raise UsageError(f"--rdzv-endpoint {host}:{port}: no route from this host ({e}); check the address, or "
                         "pass --local-addr with this host's address on the network the hosts share") from None


def interface_addresses() -> dict[str, str]:
    """{IPv4 address: interface name} of this host's (this network namespace's) interfaces that are up, from
    ``SIOCGIFADDR`` (an interface's primary address; Linux)."""
    import fcntl
    import struct

    found: dict[str, str] = {}
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            found.setdefault(addr, name)
    return found


def interface_of(addr: str) -> str:
    """The name of this host's interface that has IPv4 address ``addr`` (``lo`` for loopback addresses).

    Raises:
        UsageError: no interface of this host has ``addr``.
    """
    if addr.startswith("127."):
        return "lo"
    found = interface_addresses()
    if addr not in found:
        have = ", ".join(f"{a} ({n})" for a, n in sorted(found.items())) or "none"
        raise UsageError(f"--local-addr {addr}: no interface of this host has that address (it has: {have}); pass "
                         "one of them, or set GLOO_SOCKET_IFNAME to the interface the hosts share")
    return found[addr]


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` (an IPv4 address) belongs to this host (this network namespace)."""
    return addr.startswith("127.") or addr in interface_addresses()


def launch_hosts(fn: Callable[..., Any], args: tuple, nproc_per_node: int, min_nodes: int, max_nodes: int,
                 endpoint: str, *, max_restarts: int = 0, timeouts: Timeouts = Timeouts(),
                 local_addr: str | None = None, run_id: str | None = None,
                 monitor_interval_s: float = 0.1) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc_per_node`` processes on this host as one node of a job over several hosts
    (torchrun's ``--nnodes MIN:MAX --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT``); call
    it on every host with the same arguments. Returns {global rank: return value of the last attempt} for
    this host's ranks.

    The rendezvous store lives at ``endpoint``: the call on the host that has the endpoint's address hosts it,
    on a socket bound to that address only; the others connect to it (and wait for it, up to
    ``timeouts.store_s``). The store is unauthenticated: anyone who reaches HOST:PORT can join or disturb the
    job. The workers' own store is made by worker rank 0 bound to its host's address
    (:data:`BIND_ADDR_ENV`; torch's agent-hosted one, bound to every interface, is turned off). Gloo uses the
    interface that holds ``local_addr`` (``GLOO_SOCKET_IFNAME``, unless already set).

    Membership follows torch's c10d rendezvous: the job starts once ``min_nodes`` hosts joined (waiting
    ``timeouts.rendezvous_last_call_s`` for more, up to ``max_nodes``); a host that dies or is cut off is
    dropped after ``timeouts.keep_alive_expiry_s`` and, when its peers' collectives fail (at once for a
    closed connection, after ``timeouts.collective_s`` for a silent link), the rest restart at the smaller
    world size, each spending one of its ``max_restarts``; a host that joins later makes the others restart
    at the next round without spending one. ``fn`` resumes from its own checkpoint.

    Args:
        endpoint: ``HOST:PORT`` of the rendezvous store (never a wildcard address).
        local_addr: this host's address on the network the hosts share (MASTER_ADDR when it holds rank 0,
            gloo's interface); default: the source address of the route to the endpoint's host.
        run_id: the job's id, the same on every host (default: derived from ``endpoint``).

    Raises:
        UsageError: bad ``endpoint`` / ``local_addr`` / counts.
        RunInterruptedError: this host's workers stopped on SIGTERM/SIGINT, or this process got one.
        RuntimeLaunchError: a worker failed after the last allowed restart (its rank and why), or this host
            lost the rendezvous (the endpoint unreachable, the rendezvous closed or timed out).
    """
    import tempfile

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if nproc_per_node < 1:
        raise UsageError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    if not 1 <= min_nodes <= max_nodes:
        raise UsageError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
    if max_restarts < 0:
        raise UsageError(f"max_restarts must be at least 0, got {max_restarts}")
    timeouts.check()
    host, port = split_endpoint(endpoint)
    if host in ("0.0.0.0", "::", "*"):
        raise UsageError(f"--rdzv-endpoint {endpoint}: give the address of the host that holds the rendezvous "
                         "store, not a wildcard (the other hosts connect to it)")
    try:
        host_ip = socket.gethostbyname(host)
    except OSError as e:
        raise UsageError(f"--rdzv-endpoint {endpoint}: {host!r} does not resolve ({e})") from None
    if host_ip.startswith("127.") and host != "localhost" and not host.startswith("127."):
        raise UsageError(f"--rdzv-endpoint {endpoint}: {host!r} resolves to {host_ip} (loopback) on this host, so the "
                         "store would be out of the other hosts' reach; give the endpoint host's IP address")
    local_addr = local_addr or route_address(host_ip, port)
    try:
        socket.inet_aton(local_addr)
    except OSError:
        raise UsageError(f"--local-addr {local_addr!r}: expected an IPv4 address of this host") from None
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", BIND_ADDR_ENV: local_addr}
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = interface_of(local_addr)
    elif not is_local_address(local_addr):
        raise UsageError(f"--local-addr {local_addr}: no interface of this host has that address")
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # we report failures ourselves
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = None
    if is_local_address(host_ip):
        try:
            store = _store_on(listen_socket(host_ip, port), timeouts.store_s)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise RuntimeLaunchError(f"cannot listen on {host_ip}:{port} for the rendezvous store: {e}") from None
            # taken: another launcher on this machine (several hosts on one machine) hosts it; join as a client
    report_dir = tempfile.mkdtemp(prefix="adaptdist-launch-")
    config = _launch_config(min_nodes, max_nodes, nproc_per_node, run_id or f"adaptdist-{host_ip}-{port}",
                            f"{host_ip}:{port}", local_addr, max_restarts, timeouts, monitor_interval_s)
    where = f"this host ({local_addr}, {'holds' if store is not None else 'joined'} the rendezvous at {endpoint})"
    try:
        with _env(env, override=True), _kept_signal_handlers():
            return elastic_launch(config, _worker_main)(fn, args, timeouts.collective_s, None, report_dir,
                                                        max_restarts)
    except ChildFailedError as e:
        raise _child_failure_error(e, max_restarts, report_dir, restart_advice) from None
    except SignalException as e:
        raise RunInterruptedError(
            f"the launcher got {signal.Signals(e.sigval).name}: it was sent on to this host's {nproc_per_node} "
            f"workers, given {config.shutdown_timeout} s to stop", int(e.sigval)) from None
    except RendezvousClosedError:
        raise RuntimeLaunchError(f"{where}: the job's rendezvous is closed (the job finished or gave up before this "
                                 "host joined); start a new job, or pass another --rdzv-id") from None
    except (RendezvousError, DistError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:500]
        raise RuntimeLaunchError(f"{where} lost the job: {type(e).__name__}{f': {first}' if first else ''}; "
                                 "check that the endpoint's host runs adaptdist train and is reachable") from None
    finally:
        import shutil

        from .. import _torch_compat as compat

        compat.stop_rendezvous_heartbeats()  # left beating after a SignalException
        shutil.rmtree(report_dir, ignore_errors=True)
        if store is not None:
            _linger(store, timeouts)


def _linger(store: Any, timeouts: Timeouts) -> None:
    """Keep the rendezvous store up a moment after this host's agent ended, so the other hosts' agents can
    finish their own shutdown through it (they left the exit barrier with this one)."""
    time.sleep(min(5.0, timeouts.keep_alive_expiry_s))
    del store
