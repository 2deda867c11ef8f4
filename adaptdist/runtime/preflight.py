"""Checks before launching ranks: fail in seconds, clearly, instead of swapping for minutes."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import UsageError

log = logging.getLogger("adaptdist.runtime")
# torch, the interpreter and gloo buffers per rank process, beyond the step's tensors (measured
# RSS of an idle rank with torch imported: about 350 MiB)
RANK_OVERHEAD_BYTES = 400 * 2**20


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this host in bytes (None where /proc/meminfo is absent)."""
    p = Path(meminfo)
    if not p.is_file():
        return None
    for line in p.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_host_memory(programs: dict, optimizer: str, num_local_ranks: int, available_bytes: int | None = None,
                      enforce: bool = True) -> int:
    """Predict each local rank's peak step memory (the cost model's liveness estimate, in the metric of
    :mod:`adaptdist.runtime.memory`) and refuse a job whose ranks together would not fit in this
    host's available memory. Returns the predicted peak of the largest rank, bytes. With
    ``enforce=False`` (``train --skip-memory-check``) a job that would be refused only logs the
    refusal's message as a warning and goes ahead.

    Raises:
        UsageError: the ranks' predicted peaks plus a per-process overhead exceed the available
            memory (and ``enforce``); names both figures and what to change.
    """
    from ..cost_models.memory import estimate_memory
    from ..cost_models.schedule import build_schedule

    peak = max(int(estimate_memory(build_schedule(p), optimizer).peak_bytes) for p in _distinct(programs))
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    need = num_local_ranks * (peak + RANK_OVERHEAD_BYTES)
    gib = 2**30
    if avail is not None and need > avail:
        msg = (f"predicted peak memory {peak / gib:.1f} GiB per rank x {num_local_ranks} local ranks (plus about "
               f"{RANK_OVERHEAD_BYTES / gib:.1f} GiB of runtime each) is {need / gib:.1f} GiB, but this host has "
               f"{avail / gib:.1f} GiB available")
        if not enforce:
            log.warning("%s; running anyway (--skip-memory-check): the ranks may swap or be killed", msg)
            return peak
        raise UsageError(
            f"{msg}; lower --batch-size or --seq-len, or use a plan that shards parameters (--plan fsdp) or "
            "activations (--plan tp / dp,tp); --skip-memory-check runs it anyway (if the prediction is too high)"
        )
    log.info("predicted peak memory %.0f MiB per rank", peak / 2**20)
    return peak


def _distinct(programs: dict) -> list:
    """Rank 0 and the last rank: torch.chunk gives rank 0 the largest shards, the last the smallest; and, with
    uneven batch rows (``Plan.devices``), the rank holding the most rows."""
    ranks = sorted(programs)
    most = max(ranks, key=lambda r: (programs[r].batch_slice[1], -r))
    picked = [ranks[0]] + ([ranks[-1]] if len(ranks) > 1 else []) + ([most] if most not in (ranks[0], ranks[-1]) else [])
    return [programs[r] for r in picked]
