"""Worker for the BatchNorm / EmbeddingBag backend tests (importable by spawned ranks): each rank trains its own
rows of the global batch through ``torch.compile(model, backend=adaptdist.backend(...))`` with SGD (DDP's
contract) and records its losses, full gradients and final parameters."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import adaptdist
from backend_workers import full_grad


def factory(name: str):
    """(model, (inputs..., target), loss_fn) by name: ``convnet_nostats`` (BatchNorm without running statistics),
    ``convnet`` (with them), ``mlp_bn1d`` (BatchNorm1d with them), ``bag_mean`` / ``bag_sum`` (an EmbeddingBag over a 2-D input)."""
    from models import convnet
    from test_embedding_bag import bag_model

    if name == "mlp_bn1d":  # BatchNorm1d over [N, C] rows, with running statistics
        import torch.nn.functional as F

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
        g = torch.Generator().manual_seed(1)
        return model, (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)), F.cross_entropy
    if name.startswith("convnet"):
        model, batch, loss_fn = convnet(4, batch_norm=True)
        if name == "convnet_nostats":
            torch.manual_seed(0)
            model.norm = nn.BatchNorm2d(4, track_running_stats=False)
        return model, batch, loss_fn
    return bag_model(6, name.removeprefix("bag_"))


def backend_cases_worker(cases: list[dict], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        out = []
        for case in cases:
            torch._dynamo.reset()
            model, batch, loss_fn = factory(case["model"])
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            be = adaptdist.backend(plan=case["plan"], batch_norm=case.get("batch_norm", "local"))
            compiled = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
            losses, grads = [], []
            try:
                for _ in range(steps):
                    x, y = (t.chunk(world)[rank] for t in batch)
                    loss = loss_fn(compiled(x), y)
                    loss.backward()
                    losses.append(loss.item())
                    grads.append({n: full_grad(p) for n, p in model.named_parameters()})
                    opt.step()
                    opt.zero_grad()
            except Exception as e:  # the backend's errors arrive wrapped by Dynamo (BackendCompilerFailed)
                out.append({"error": f"{type(e).__name__}: {e}"})
                continue
            out.append({"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled),
                        "buffers": {n: b.clone() for n, b in model.named_buffers()}})  # as the user sees them
        return out
    finally:
        dist.destroy_process_group()
