"""Injected faults, for the fault-injection tests and ``benchmarks/bench_faults.py``.

``ADAPTDIST_INJECT_FAULT=KIND:RANK:STEP`` in a run's environment makes rank ``RANK`` fail just before
training step ``STEP`` (1-based) of the run's first attempt only (a restarted attempt runs clean, so the
restart can be checked). Kinds:

- ``kill``: the rank SIGKILLs itself (as the out-of-memory killer or a lost machine would);
- ``raise``: the step raises an exception;
- ``stall``: the rank sleeps for an hour (a hung process: its peers must time out and name it);
- ``term``: the rank gets SIGTERM (a spot machine's preemption notice);
- ``lose-node``: the rank's agent (its parent) is SIGKILLed, and the rank with it: an elastic job loses a
  member and re-forms at the smaller size.

Nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

ENV_VAR = "ADAPTDIST_INJECT_FAULT"
KINDS = ("kill", "raise", "stall", "term", "lose-node")


class InjectedFault(RuntimeError):
    """The exception of an injected ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``rank`` before step ``step`` (1-based)."""

    kind: str
    rank: int
    step: int

    @classmethod
    def from_env(cls, environ=os.environ) -> "Fault | None":
        """The fault ``ADAPTDIST_INJECT_FAULT`` names, or None.

        Raises:
            UsageError: the variable is not ``KIND:RANK:STEP`` with a known kind.
        """
        text = environ.get(ENV_VAR)
        if not text:
            return None
        parts = text.split(":")
        try:
            kind, rank, step = parts[0], int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            kind = None
        if kind not in KINDS or len(parts) != 3:
            raise UsageError(f"{ENV_VAR}={text!r}: expected KIND:RANK:STEP with KIND one of {', '.join(KINDS)}")
        return cls(kind, rank, step)

    def maybe_fire(self, rank: int, step: int, attempt: int, out_dir: str | None = None) -> None:
        """Fire when this is the rank and the step of the fault, in the run's first attempt; first record it in
        ``out_dir/fault.json`` (kind, rank, step, time) for the benchmark's fault-to-recovery time."""
        if attempt != 0 or rank != self.rank or step != self.step:
            return
        if out_dir is not None:
            import json

            (Path(out_dir) / "fault.json").write_text(json.dumps({"kind": self.kind, "rank": rank, "step": step,
                                                                  "time_s": time.time()}))
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "lose-node":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "stall":
            time.sleep(3600)
        else:
            raise InjectedFault(f"injected fault: rank {rank} raises before step {step}")
