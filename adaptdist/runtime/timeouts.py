"""The timeouts of a run, and the order they must keep.

A fault is noticed by one timeout and handled under the next: a peer that stalls is noticed by the
collective timeout of the ranks waiting for it; their agents then stop them, re-enter the rendezvous
and wait there for everyone else. If the rendezvous gave up before the last survivor could arrive,
a recoverable fault would end the job. So each timeout must exceed the ones it waits on:

===========================  =======  ============================================================
timeout (``Timeouts``)       default  must exceed
===========================  =======  ============================================================
``collective_s``             120 s    the longest legitimate skew between ranks at a collective
                                      (a step plus a checkpoint write, the first step's warm-up)
``compile_wait_s``           300 s    rank 0's compile of the programs for a new world size
``store_s``                  330 s    ``max(collective_s, compile_wait_s)``: the agents' store reads and
                                      the wait for compiled programs go through it
``shutdown_grace_s``         30 s     one step plus one checkpoint write (SIGTERM -> SIGKILL)
``keep_alive_interval_s``    2 s      --
  x ``keep_alive_attempts``  3        (expiry 6 s: a killed agent is dropped after it; >= 2 beats)
``rendezvous_last_call_s``   2 s      --  (after the minimum of nodes joined, wait this for more)
``rendezvous_join_s``        370 s    ``max(collective_s, compile_wait_s)`` + ``max(30 s, shutdown_grace_s)``
                                      (torch's agent gives a restarted worker 30 s after SIGTERM) +
                                      30 s (a worker's start) + keep-alive expiry + last call
===========================  =======  ============================================================

``Timeouts.for_collective(C)`` derives every other value from C in that order; ``check()`` refuses
explicit settings that break it. Where torch has no knob, the constant used is named here:
:data:`RESTART_STOP_S` (``SimpleElasticAgent._stop_workers`` waits a fixed 30 s before SIGKILL at a
restart, whatever ``--shutdown-timeout`` says) and :data:`WORKER_START_S` (spawn, ``import torch``,
``init_process_group`` on a loaded machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..errors import UsageError

RESTART_STOP_S = 30.0
"""Seconds torch's agent waits for its SIGTERM'd workers at a restart before SIGKILL (fixed in torch 2.13:
``LocalElasticAgent._stop_workers`` calls ``_shutdown()`` with its default ``timeout=30``)."""

WORKER_START_S = 30.0
"""Seconds allowed for a restarted worker to start and reach its first collective (spawn, imports, init)."""

DEFAULT_COMPILE_WAIT_S = 300.0
"""Default seconds ranks wait for rank 0 to compile the programs for a new world size."""


@dataclass(frozen=True)
class Timeouts:
    """Every timeout of a run, in seconds (see the module docstring for their order).

    Attributes:
        collective_s: how long one collective (and ``init_process_group``) waits for a peer
            (``--collective-timeout-s``; ``--timeout-s`` is its alias).
        compile_wait_s: how long ranks wait for rank 0 to compile the programs for a new world size.
        store_s: the timeout of the rendezvous store's operations (the agents' ``read_timeout``) and of a
            worker's wait for compiled programs. The workers' own store times out with ``collective_s`` (as
            torch sets it), so a longer wait passes its own: ``store.wait([key], timedelta(seconds=...))``.
        shutdown_grace_s: how long a SIGTERM'd (or SIGINT'd) worker has to write its checkpoint and exit
            before the agent sends SIGKILL (torch's ``shutdown_timeout``).
        keep_alive_interval_s: how often each agent tells the rendezvous it is alive.
        keep_alive_attempts: missed keep-alives after which an agent is dropped from the rendezvous.
        rendezvous_last_call_s: once the minimum of nodes has joined, how long the rendezvous waits for more.
        rendezvous_join_s: how long an agent waits in the rendezvous for the others before it gives up.
    """

    collective_s: float = 120.0
    compile_wait_s: float = DEFAULT_COMPILE_WAIT_S
    store_s: float = 330.0
    shutdown_grace_s: float = 30.0
    keep_alive_interval_s: float = 2.0
    keep_alive_attempts: int = 3
    rendezvous_last_call_s: float = 2.0
    rendezvous_join_s: float = 370.0

    @classmethod
    def for_collective(cls, collective_s: float, **overrides: float) -> "Timeouts":
        """Timeouts ordered after a collective timeout of ``collective_s`` seconds; ``overrides`` set other
        fields by name first (e.g. ``shutdown_grace_s=60``), the values that depend on them derived after.

        Raises:
            UsageError: ``collective_s`` or an override is not positive, an unknown field is named, or an
                override breaks the order (see :meth:`check`).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise UsageError(f"Timeouts has no field {', '.join(unknown)}; fields: {', '.join(sorted(names))}")
        base = cls()
        compile_wait = overrides.get("compile_wait_s", max(base.compile_wait_s, collective_s))
        waits = max(collective_s, compile_wait)
        grace = overrides.get("shutdown_grace_s", base.shutdown_grace_s)
        interval = overrides.get("keep_alive_interval_s", base.keep_alive_interval_s)
        attempts = overrides.get("keep_alive_attempts", base.keep_alive_attempts)
        last_call = overrides.get("rendezvous_last_call_s", base.rendezvous_last_call_s)
        derived = cls(
            collective_s=collective_s,
            compile_wait_s=compile_wait,
            store_s=overrides.get("store_s", waits + 30.0),
            shutdown_grace_s=grace,
            keep_alive_interval_s=interval,
            keep_alive_attempts=int(attempts),
            rendezvous_last_call_s=last_call,
            rendezvous_join_s=overrides.get(
                "rendezvous_join_s",
                math.ceil((waits + _restart_stop(grace) + WORKER_START_S + interval * attempts + last_call)
                          / 10.0) * 10.0),
        )
        derived.check()
        return derived

    def with_collective(self, collective_s: float) -> "Timeouts":
        """These timeouts with ``collective_s`` changed and what depends on it re-derived when it no longer
        fits (values that still fit are kept). Raises UsageError as :meth:`check`."""
        if collective_s == self.collective_s:
            return self
        candidate = replace(self, collective_s=collective_s)
        try:
            candidate.check()
            return candidate
        except UsageError:
            keep = {f.name: getattr(self, f.name) for f in fields(self)
                    if f.name in ("shutdown_grace_s", "keep_alive_interval_s", "keep_alive_attempts",
                                  "rendezvous_last_call_s")}
            return Timeouts.for_collective(collective_s, **keep)

    def check(self) -> "Timeouts":
        """Returns self when the timeouts keep the order of the module docstring.

        Raises:
            UsageError: a value is not positive, or a timeout would fire before one it depends on; the
                message names both values.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise UsageError(f"timeout {f.name} must be positive, got {value}")
        if self.keep_alive_attempts < 2:
            raise UsageError(f"keep_alive_attempts={self.keep_alive_attempts} must be at least 2 (one late "
                             f"keep-alive of a live agent on a loaded machine must not drop it)")
        waits_name, waits = max((("collective_s", self.collective_s), ("compile_wait_s", self.compile_wait_s)),
                                key=lambda nv: nv[1])
        if self.store_s < waits:
            raise UsageError(
                f"store_s={self.store_s:g} must be at least {waits_name}={waits:g}: store waits serve the "
                f"collectives' set-up and the wait for compiled programs; raise store_s or lower {waits_name}")
        need = (waits + _restart_stop(self.shutdown_grace_s) + WORKER_START_S + self.keep_alive_expiry_s
                + self.rendezvous_last_call_s)
        if self.rendezvous_join_s < need:
            raise UsageError(
                f"rendezvous_join_s={self.rendezvous_join_s:g} must exceed {waits_name}={waits:g} + "
                f"max({RESTART_STOP_S:g}, shutdown_grace_s={self.shutdown_grace_s:g}) + worker start "
                f"{WORKER_START_S:g} + keep-alive expiry {self.keep_alive_expiry_s:g} + "
                f"rendezvous_last_call_s={self.rendezvous_last_call_s:g} = {need:g} s, or the survivors of a "
                f"stalled peer give up on the rendezvous before the last of them arrives; raise "
                f"rendezvous_join_s or lower {waits_name}")
        if self.rendezvous_last_call_s >= self.rendezvous_join_s:
            raise UsageError(f"rendezvous_last_call_s={self.rendezvous_last_call_s:g} must be below "
                             f"rendezvous_join_s={self.rendezvous_join_s:g}")
        return self

    @property
    def keep_alive_expiry_s(self) -> float:
        """Seconds after its last keep-alive that a silent (killed) agent is dropped from the rendezvous."""
        return self.keep_alive_interval_s * self.keep_alive_attempts

    def rdzv_configs(self) -> dict[str, object]:
        """The c10d rendezvous settings (torch's ``--rdzv-conf`` keys; whole seconds, rounded up)."""
        return {
            "join_timeout": _whole(self.rendezvous_join_s),
            "last_call_timeout": _whole(self.rendezvous_last_call_s),
            "close_timeout": _whole(max(self.shutdown_grace_s, 10.0)),
            "read_timeout": _whole(self.store_s),
            "keep_alive_interval": _whole(self.keep_alive_interval_s),
            "keep_alive_max_attempt": int(self.keep_alive_attempts),
        }

    def rdzv_conf_arg(self, **extra: object) -> str:
        """:meth:`rdzv_configs` (and ``extra``) as torchrun's ``--rdzv-conf`` value ``k=v,k=v``."""
        conf = {**self.rdzv_configs(), **extra}
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in conf.items())


def _restart_stop(shutdown_grace_s: float) -> float:
    return max(RESTART_STOP_S, shutdown_grace_s)


def _whole(seconds: float) -> int:
    return max(1, math.ceil(seconds))
