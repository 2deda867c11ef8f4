"""Worker for tests/test_skipped_frames.py: a model whose forward Dynamo skips (a graph break in a loop)."""

from datetime import timedelta

import torch
import torch.distributed as dist

import adaptdist
from adaptdist.models.zoo import TopKMoE


def skipped_frame_worker(by_name: bool, timeout_s: float = 60.0) -> str:
    """One step of the zoo's Mixtral-style MoE (``torch.where`` per expert inside a for loop) through the
    backend on this rank's rows; returns the error text ("" if it trained)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        torch.manual_seed(0)
        model = TopKMoE()
        compiled = torch.compile(model, backend="adaptdist" if by_name else adaptdist.backend(plan="dp"))
        try:
            compiled(torch.randn(2, 3, 8)).sum().backward()
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        return ""
    finally:
        dist.destroy_process_group()
