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


def cumulative_sequential() -> torch.nn.Sequential:
    """An nn.Sequential MLP whose BatchNorm1d keeps a cumulative average (``momentum=None``), compiled directly:
    Dynamo runs the whole call eagerly (the break is inside Sequential's loop) and never calls the backend."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=None), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


def bn_cumulative_worker(batch_norm: str, sequential: bool = False, timeout_s: float = 60.0) -> str:
    """One step of :class:`CumulativeBatchNorm` (or :func:`cumulative_sequential`) through the backend; returns the
    error text ("" if it trained)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        torch.manual_seed(0)
        model, x = ((cumulative_sequential(), torch.randn(4, 4)) if sequential else
                    (CumulativeBatchNorm(), torch.randn(2, 2, 5, 5)))
        compiled = torch.compile(model, backend=adaptdist.backend(plan="dp", batch_norm=batch_norm))
        try:
            compiled(x).sum().backward()
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


class RNNHead(torch.nn.Module):
    """An ``nn.GRU`` and a linear head: Dynamo skips the whole frame (RNNs unless ``allow_rnn``)."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(8, 16, batch_first=True)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        h, _ = self.rnn(x)
        return self.out(h[:, -1])


class StepCounter(torch.nn.Module):
    """A linear layer and a step-counter buffer every rank updates alike (``self.n += 1``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.fc(x)


def counter_batches(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=g) for _ in range(steps)]


def graphless_call_worker(timeout_s: float = 60.0) -> dict:
    """Through the backend on this rank's rows: one step of :class:`RNNHead` (Dynamo runs its frame eagerly: the
    error text), then three SGD steps of
    :class:`StepCounter` (its parameters and counter after them, or the error text)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    try:
        cases = {"rnn": (RNNHead(), torch.randn(4, 5, 8))}
        for name, (model, x) in cases.items():
            torch._dynamo.reset()
            try:
                torch.compile(model, backend=adaptdist.backend(plan="dp"))(x.chunk(world)[rank]).sum().backward()
                out[name] = ""
            except Exception as e:  # noqa: BLE001 - the test reads the message
                out[name] = f"{type(e).__name__}: {e}"
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = StepCounter()
        compiled = torch.compile(model, backend="adaptdist", dynamic=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for x in counter_batches():
                compiled(x.chunk(world)[rank]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            out["counter"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out["counter"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        dist.destroy_process_group()
