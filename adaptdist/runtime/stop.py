"""Graceful stop on SIGTERM (a spot machine's preemption notice) and SIGINT (Ctrl-C), decided collectively.

In a worker, :class:`StopRequest` replaces the SIGTERM/SIGINT handlers by ones that only note the signal;
the step loop calls :meth:`StopRequest.agreed` after every step, a one-element ``all_reduce(MAX)`` of the
noted signal, so every rank learns of a signal any rank got and all stop after the same step; the loop then
writes its checkpoint and exits with :func:`stop_exit_code` (128 + signal: 143 for SIGTERM, 130 for SIGINT).

Who sends what (torch 2.13's elastic agent, ``torch.distributed.launcher.api`` / ``agent/server/api.py``):

* SIGTERM/SIGINT (and SIGHUP, SIGQUIT) to the launcher: the agent's handler raises ``SignalException``;
  ``SimpleElasticAgent.run`` then sends the SAME signal to every worker and waits ``shutdown_timeout`` seconds
  (``LaunchConfig.shutdown_timeout``, torchrun's ``--shutdown-timeout``, env
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30; :func:`adaptdist.runtime.launch.launch_local` sets it to
  ``Timeouts.shutdown_grace_s``; torch 2.11 has no such setting and waits a fixed 30 s) before SIGKILL, then
  re-raises ``SignalException`` (no restart).
* Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the workers of
  ``launch_local`` get it directly AND forwarded by the agent; the flag is set either way.
* A restart (a peer failed) or a membership change (a node joined an elastic job): the agent SIGTERMs its
  workers and waits a fixed 30 s before SIGKILL (``_stop_workers`` ignores ``shutdown_timeout``). A
  StopRequest then stops the workers after the current step, checkpoint written, so a scale-up loses
  nothing when a step plus a checkpoint fit in those 30 s.
* A worker that exits 143/130 on its own is a failed worker to the agent: with restarts left it is
  restarted (from the checkpoint it just wrote); without, ``launch_local`` raises ``RunInterruptedError``.

:func:`interrupted_exit_code` turns what a launcher sees (``SignalException``, ``RunInterruptedError``,
``KeyboardInterrupt``) into the exit code, so the CLI can print one line and exit 130/143 instead of a traceback.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_exit_code(signum: int) -> int:
    """The exit code of a process that stopped on ``signum``: 128 + signum (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


class StopRequest:
    """Notes SIGTERM/SIGINT in a worker and agrees with the other ranks on when to stop.

    Use as a context manager around the step loop (handlers are installed on entry, only from the main
    thread, and the previous ones restored on exit)::

        with StopRequest() as stop:
            for step in range(start, steps):
                train_step(step)
                sig = stop.agreed(step)
                if sig is not None:
                    save_checkpoint(step)
                    raise SystemExit(stop_exit_code(sig))

    Args:
        signals: the signals to note (default SIGTERM and SIGINT).
        every: agree every ``every`` steps (``step % every == 0``; 1: every step). The agreement is one
            1-element all_reduce (about 0.1-0.3 ms on 2 gloo ranks on one machine, next to steps of
            milliseconds or more), so 1 is the default; every rank must use the same value.
        group: the process group to agree in (default the default group).
        stuck_after_s: a signal that arrives when the current step began longer ago than this (the collective
            timeout: the peers have failed already) ends the process at once with 128 + signal (None: never).
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, every: int = 1, group: Any = None,
                 stuck_after_s: float | None = None):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.signals = tuple(signals)
        self.every = every
        self.group = group
        self.stuck_after_s = stuck_after_s
        self._signum: int | None = None
        self._saved: dict[int, Any] = {}
        self._step_started: float | None = None

    def step_started(self) -> None:
        """The step loop entered a step (for ``stuck_after_s``)."""
        import time

        self._step_started = time.monotonic()

    @property
    def requested(self) -> int | None:
        """The signal this rank got (the first one), None if none: this rank's view only."""
        return self._signum

    def request(self, signum: int) -> None:
        """Note ``signum`` as if it had arrived (what the handler does; the first signal wins)."""
        if self._signum is None:
            self._signum = int(signum)

    def _handler(self, signum: int, frame: Any) -> None:
        import time

        # stuck in one step for longer than a collective may wait: the peers have given up on this rank, so no
        # step boundary will come where the ranks could agree and checkpoint; exit now rather than wait for the
        # agent's SIGKILL (torch's restart waits a fixed 30 s for it)
        if (self.stuck_after_s is not None and self._step_started is not None
                and time.monotonic() - self._step_started > self.stuck_after_s):
            os._exit(stop_exit_code(signum))
        self.request(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._saved.clear()

    def agreed(self, step: int) -> int | None:
        """Collectively: the signal to stop on after ``step`` when any rank got one (the largest number if
        ranks got different ones), else None. Every rank must call it after the same steps; off the agreement
        steps (``step % every``) it returns None without communicating. Without a process group (one
        process) it returns this rank's signal.

        Raises:
            the collective's error when a peer is gone (see :func:`adaptdist.runtime.heartbeat.named_timeout`).
        """
        if step % self.every:
            return None
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self._signum
        t = torch.tensor([self._signum or 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        value = int(t.item())
        return value or None


def interrupted_exit_code(exc: BaseException) -> int | None:
    """The exit code for a launcher that ``exc`` interrupted: 128 + signal for torch's agent's
    ``SignalException`` (this process got SIGTERM/SIGINT/...) and for ``RunInterruptedError`` (the workers
    stopped on one), 130 for ``KeyboardInterrupt``; None when ``exc`` is no interruption."""
    from ..errors import RunInterruptedError

    if isinstance(exc, RunInterruptedError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return stop_exit_code(signal.SIGINT)
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
    except ImportError:  # a torch without the elastic agent
        return None
    if isinstance(exc, SignalException):
        return stop_exit_code(exc.sigval)
    return None


def interrupted_message(exc: BaseException) -> str | None:
    """One line for the user when ``exc`` interrupted the run (see :func:`interrupted_exit_code`), else None."""
    code = interrupted_exit_code(exc)
    if code is None:
        return None
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    return f"interrupted by {name}"
