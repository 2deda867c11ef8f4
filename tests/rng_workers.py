"""Workers for tests/test_global_rng.py's real gloo runs (launched by adaptdist.runtime.launch.launch_local)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import adaptdist


class DropMLP(nn.Module):
    """Returns the logits and the dropout output (on a strictly positive input: 0 exactly where the mask is)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 24)
        self.drop = nn.Dropout(0.4)
        self.b = nn.Linear(24, 3)

    def forward(self, x):
        h = self.drop(torch.sigmoid(self.a(x)) + 0.1)
        h = h + 0.05 * torch.randn_like(h)
        return self.b(h), h


def drop_mlp_and_batches(rows: int, steps: int):
    torch.manual_seed(0)
    model = DropMLP()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(steps)]


def backend_rng_worker(rows_per_rank: int, steps: int, lr: float, seed: int, timeout_s: float = 120.0) -> dict:
    """``torch.compile(model, backend=adaptdist.backend(plan="dp", rng="global"))``, every rank seeded ``seed``,
    each rank passing its ``rows_per_rank`` rows of the global batch: per step its dropout output's mask; the
    final parameters and generator state; then the error of a compile with ranks seeded differently."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model, batches = drop_mlp_and_batches(rows_per_rank * world, steps)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        compiled = torch.compile(model, backend=adaptdist.backend(plan="dp", rng="global"), fullgraph=True)
        torch.manual_seed(seed)
        masks = []
        for x, y in batches:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            out, h = compiled(x)
            F.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
            masks.append(h.detach() != 0)
        result = {"masks": masks, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                  "rng": torch.get_rng_state()}
        # then ranks seeded differently (seed + rank) under rng='global': every rank must stop with a clear error
        torch._dynamo.reset()
        other = torch.compile(model, backend=adaptdist.backend(plan="dp", rng="global"), fullgraph=True)
        torch.manual_seed(seed + rank)
        try:
            other(batches[0][0][:2])[0].sum().backward()
            result["unseeded"] = "no error"
        except Exception as e:  # Dynamo wraps the backend's error
            result["unseeded"] = f"{type(e).__name__}: {e}"
        return result
    finally:
        dist.destroy_process_group()


def hf_gpt2_dropout(seed: int = 0):
    """A Hugging Face GPT-2 from a small config, in training mode with dropout 0.1 everywhere."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, resid_pdrop=0.1,
                                      embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)).train()


def hf_gpt2_loss(model, x, y):
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())


def hf_gpt2_rng_worker(x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, seed: int, plan: str,
                       timeout_s: float = 180.0) -> dict:
    """HF GPT-2 with dropout through adaptdist.backend(plan=plan, rng="global"), every rank seeded ``seed``: each
    step's loss and the final parameters."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model = hf_gpt2_dropout()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        compiled = torch.compile(model, backend=adaptdist.backend(plan=plan, rng="global"), fullgraph=True)
        torch.manual_seed(seed)
        losses = []
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        for _ in range(steps):
            loss = hf_gpt2_loss(compiled, xs, ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        return {"losses": losses, "params": adaptdist.full_state_dict(compiled)}
    finally:
        dist.destroy_process_group()


class TimeMajorDrop(nn.Module):
    """The tester's ``drop_tbd``: a conv over ``[B, 3, L, 1]``, permuted to time-major ``[L, B, 8]``, then dropout
    there (the batch on dim 1), a mean over time and a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, (3, 1), padding=(1, 0))
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = F.relu(self.conv(x)).squeeze(-1).permute(2, 0, 1)
        h = F.dropout(self.lin(h), 0.3, self.training)
        return self.head(h.mean(0))


def time_major_and_batch(rows: int, seq: int = 5):
    torch.manual_seed(0)
    model = TimeMajorDrop()
    g = torch.Generator().manual_seed(10)
    return model, torch.randn(rows, 3, seq, 1, generator=g), torch.randn(rows, 2, generator=g)


def backend_time_major_worker(rows_per_rank: int, steps: int, lr: float, seed: int, plan: str,
                              timeout_s: float = 120.0) -> dict:
    """:class:`TimeMajorDrop` through ``adaptdist.backend(plan=plan, rng="global")``, every rank seeded ``seed``,
    each rank passing its rows: each step's mean loss over ranks, the first step's gradients (averaged, as DDP's)
    and the final parameters."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model, x, y = time_major_and_batch(rows_per_rank * world)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        compiled = torch.compile(model, backend=adaptdist.backend(plan=plan, rng="global"), dynamic=False)
        torch.manual_seed(seed)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        losses, grads = [], None
        for _ in range(steps):
            loss = F.mse_loss(compiled(xs), ys)
            loss.backward()
            if grads is None:
                # dp: every rank holds the whole (averaged) gradient; sharded plans hold shards, not compared
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()} if plan == "dp" else {}
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        return {"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled),
                "rng": torch.get_rng_state()}
    finally:
        dist.destroy_process_group()
