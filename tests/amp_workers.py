"""Models and worker functions of the mixed-precision (autocast) and activation-checkpointing tests
(importable by spawned ranks): the user's ordinary loop through ``torch.compile(model,
backend=adaptdist.backend(...))``, each rank on its own rows, under ``torch.autocast`` when a case asks."""

from __future__ import annotations

import os
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import adaptdist
from models import mlp, tiny_gpt, tiny_llama


class InnerAutocast(nn.Module):
    """An autocast region written inside the model: the first layer in bf16, the head in float32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 5)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.fc1(x))
        return self.fc2(h.float())


def inner_autocast(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = InnerAutocast()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)), F.cross_entropy


def _checkpointed(self, *args):
    return checkpoint(type(self).forward, self, *args, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """A user's activation checkpointing: each transformer block's forward through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (parameter names unchanged)."""
    for block in getattr(model, "blocks", None) or model.layers:
        block.forward = types.MethodType(_checkpointed, block)
    return model


FACTORIES = {
    "gpt": lambda batch: tiny_gpt(batch, 8, seed=0, num_heads=4),
    "llama": lambda batch: tiny_llama(batch, 8, seed=0),
    "mlp": lambda batch: mlp(batch, seed=0),
    "inner_autocast": inner_autocast,
}


def build(case: dict):
    """(model, batch, loss_fn) of a case, its blocks checkpointed when ``case["checkpoint"]``."""
    model, batch, loss_fn = FACTORIES[case["model"]](case["batch"])
    if case.get("checkpoint"):
        checkpoint_blocks(model)
    return model, batch, loss_fn


def autocast_of(case: dict):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(case.get("bf16")))


def eager_steps(case: dict, world: int, steps: int, lr: float):
    """Single-process eager under the case's settings: per step each rank's loss on its rows and the gradients
    of their mean; the output dtype; final parameters."""
    model, (x, y), loss_fn = build(case)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history, dtype = [], None
    for _ in range(steps):
        losses = []
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            with autocast_of(case):
                out = model(xr)
                losses.append(loss_fn(out, yr))
            dtype = out.dtype
        (sum(losses) / world).backward()
        history.append(([v.item() for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}, dtype


def compiled_steps(case: dict, rank: int, world: int, steps: int, lr: float) -> dict:
    """The case through the backend on this rank's rows (a world of one without a process group)."""
    from backend_workers import full_grad

    model, (x, y), loss_fn = build(case)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    be = adaptdist.backend(plan=case.get("plan", "dp"))
    compiled = torch.compile(model, backend=be, fullgraph=True)
    xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
    losses, grads, dtype = [], [], None
    for _ in range(steps):
        with autocast_of(case):
            out = compiled(xr)
            loss = loss_fn(out, yr)
        dtype = out.dtype
        loss.backward()
        losses.append(loss.item())
        grads.append({n: full_grad(p) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled), "dtype": dtype,
            "graphs": len(be.compiled)}


def compiled_worker(cases: list[dict], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    """Every case through the backend on this rank (one gloo process group for all)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        return [compiled_steps(case, rank, world, steps, lr) for case in cases]
    finally:
        dist.destroy_process_group()
