"""Each rank's record of its attempts, so a restarted job can say which rank failed and why.

Every rank writes ``OUT/status/attempt{A}/rank{R}.json`` when it starts (pid, host), as it checkpoints, after a
step at most every :data:`STATUS_EVERY_S` seconds, and when it ends (finished, stopped by a signal, or failed with
the error's text). A rank killed without a word (SIGKILL, the out-of-memory killer, a lost machine) leaves its
record at ``running``: after a restart, :func:`failure_of` reads the previous attempt's records and names the
cause: a peer's collective timeout naming the rank that did not arrive (a stall; a lost connection is not one),
else the rank killed without a word, else the first error.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

# Seconds between two step records of a running rank: the step named for a rank killed without a word is at most
# this old, for one small file write a second.
STATUS_EVERY_S = 1.0


class RankStatus:
    """This rank's record for one attempt (all writes atomic: a temporary file, then a rename)."""

    def __init__(self, out_dir: str | Path, rank: int, attempt: int):
        self.path = Path(out_dir) / "status" / f"attempt{attempt}" / f"rank{rank}.json"
        self.record = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "host": socket.gethostname(),
                       "state": "running", "step": None, "error": None, "error_type": None, "time_s": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def update(self, **fields) -> None:
        """Set ``fields`` (state, step, error) and rewrite the record."""
        self.record.update(fields, time_s=time.time())
        self._write()

    def note_step(self, step: int, every_s: float = STATUS_EVERY_S) -> bool:
        """Record ``step`` (steps done) if the record is at least ``every_s`` seconds old; returns whether it
        wrote."""
        if time.time() - self.record["time_s"] < every_s:
            return False
        self.update(step=step)
        return True

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.record))
        tmp.replace(self.path)


def failure_of(out_dir: str | Path, attempt: int) -> str | None:
    """Why attempt ``attempt`` ended, in words: the rank killed without a word, else the first error; None when
    no record of that attempt says it failed."""
    d = Path(out_dir) / "status" / f"attempt{attempt}"
    records = []
    for p in sorted(d.glob("rank*.json")):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    lost = ("Connection closed", "Connection reset", "Broken pipe", "its process is gone")  # a peer died: not a stall
    stalls = sorted((r for r in records if r.get("error_type") == "CollectiveTimeoutError" and not r.get("peer_lost")
                     and not r.get("dead_ranks") and not any(t in (r.get("error") or "") for t in lost)),
                    key=lambda r: r["time_s"])
    if stalls:  # a peer waited out the collective timeout and named the rank that did not arrive
        r = stalls[0]
        return f"rank {r['rank']} timed out: {r['error']}"
    silent = [r for r in records if r.get("state") == "running"]
    if silent:
        r = min(silent, key=lambda r: r["time_s"])
        return (f"rank {r['rank']} (pid {r['pid']} on {r['host']}) died without a word after step {r['step'] or 0} "
                f"(the last step it recorded: it records a step at most every {STATUS_EVERY_S:g} s, so it may have "
                "died a few steps later; SIGKILL: the out-of-memory killer, an outside kill or a lost machine)")
    failed = sorted((r for r in records if r.get("state") in ("failed", "stopped")), key=lambda r: r["time_s"])
    if failed:
        r = failed[0]
        return f"rank {r['rank']} (pid {r['pid']} on {r['host']}) {r['state']}: {r['error']}"
    return None


def last_failure(out_dir: str | Path) -> str | None:
    """:func:`failure_of` the newest attempt recorded under ``OUT/status``."""
    attempts = [int(p.name[len("attempt"):]) for p in (Path(out_dir) / "status").glob("attempt*")
                if p.name[len("attempt"):].isdigit()]
    return failure_of(out_dir, max(attempts)) if attempts else None
