"""Worker for tests/test_skipped_frames.py: a model whose forward Dynamo skips (a graph break in a loop)."""

from datetime import timedelta

import torch
import torch._dynamo
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
            error = ""
        except Exception as e:  # noqa: BLE001 - the test reads the message
            error = f"{type(e).__name__}: {e}"
        # Dynamo still works after the refusal: reset, then another model compiles and trains
        torch._dynamo.reset()
        other = torch.compile(torch.nn.Linear(8, 2), backend=adaptdist.backend(plan="dp"))
        other(torch.randn(2, 8)).sum().backward()
        return error
    finally:
        dist.destroy_process_group()


class CumulativeBatchNorm(torch.nn.Module):
    """A conv net whose BatchNorm keeps a cumulative average (``momentum=None``)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4, momentum=None)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def bn_cumulative_worker(batch_norm: str, timeout_s: float = 60.0) -> str:
    """One step of :class:`CumulativeBatchNorm` through the backend; returns the error text ("" if it trained)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        torch.manual_seed(0)
        compiled = torch.compile(CumulativeBatchNorm(), backend=adaptdist.backend(plan="dp", batch_norm=batch_norm))
        try:
            compiled(torch.randn(2, 2, 5, 5)).sum().backward()
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        return ""
    finally:
        dist.destroy_process_group()


class BatchEMA(torch.nn.Module):
    """A linear layer keeping a running average of its input rows in a buffer, updated in the forward."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc(x)


def batch_ema_worker(timeout_s: float = 60.0) -> str:
    """One step of :class:`BatchEMA` through the backend; returns the error text ("" if it trained)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        compiled = torch.compile(BatchEMA(), backend=adaptdist.backend(plan="dp"))
        try:
            compiled(torch.randn(2, 8)).sum().backward()
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        return ""
    finally:
        dist.destroy_process_group()
