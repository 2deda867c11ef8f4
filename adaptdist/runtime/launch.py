"""Launch N local ranks through torch's elastic agent (what torchrun uses)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable

from ..errors import RuntimeLaunchError


def launch_local(fn: Callable[..., Any], args: tuple, nproc: int, *, monitor_interval_s: float = 0.1
                 ) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local processes; returns {rank: return value}.

    Rendezvous is standalone on a free localhost port; no restarts. Each process
    gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in its environment.

    Raises:
        RuntimeLaunchError: a rank failed; the message carries the first failure's error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # we report failures ourselves
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"adaptdist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
    )
    try:
        return elastic_launch(config, fn)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", str(msg))
        msg = str(msg).strip() or f"exit code {failure.exitcode}"
        raise RuntimeLaunchError(f"rank {rank} failed: {msg}") from None
