"""Checks of meaning on values a file gives, beyond their types: what a cluster file may call a host and
write in its calibration block (the rest of a cluster file's rules live in :mod:`adaptdist.cluster_file`,
the ranges of its figures in :mod:`adaptdist.limits`). Each returns why a value is refused, or None."""

from __future__ import annotations

import datetime

MAX_HOST_NAME = 253
"""The longest host name (a DNS name's limit)."""

BACKENDS = ("", "gloo", "nccl")
"""What ``calibration.backend`` may say ("": not recorded)."""


def host_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a host's name (None: it can): too long, blank at either end, or holding control
    characters (a newline would forge lines in logs and reports)."""
    if len(name) > MAX_HOST_NAME:
        return f"is {len(name)} characters long; a host name has at most {MAX_HOST_NAME}"
    if name != name.strip():
        return f"is {name!r}, with blanks at an end; write the host name alone"
    if not name.isprintable():
        return f"is {name!r}, which holds control characters; write the host name alone"
    return None


def calibration_problem(key: str, value: str) -> str | None:
    """Why ``value`` cannot be ``calibration.<key>`` (``measured_at``: an ISO 8601 time; ``backend``: one of
    :data:`BACKENDS`), or None."""
    if key == "backend" and value not in BACKENDS:
        return f"is {value!r}; the backends are 'gloo' (cpu) and 'nccl' (cuda)"
    if key == "measured_at" and value:
        try:
            datetime.datetime.fromisoformat(value)
        except ValueError:
            return f"is {value!r}, not an ISO 8601 time such as '2025-01-01T12:00:00+00:00'"
    return None
