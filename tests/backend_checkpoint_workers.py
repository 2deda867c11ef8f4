"""Worker functions for tests/test_backend_checkpoint.py (importable by spawned ranks).

A small model whose parameters shard unevenly, and with an empty shard, over 3 ranks under fsdp
(``fc1.weight [7, 12]``: rows 3|3|1, 4|3 on 2 ranks; ``fc2.weight [4, 7]``: rows 2|2|0), trained through
``torch.compile(model, backend=adaptdist.backend(plan=...))`` on deterministic global batches (the batch of
step s comes from seed s; each rank takes its rows, DDP's contract).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import adaptdist

GLOBAL_BATCH = 6  # rows per step: divisible by 1, 2 and 3 ranks


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 7)
        self.fc2 = nn.Linear(7, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0, kind: str = "small") -> nn.Module:
    """``small`` (:class:`Small`) or ``gpt`` (the built-in GPT, dim 32, 4 heads: tensor-parallel by heads)."""
    torch.manual_seed(seed)
    if kind == "moe-list":  # 4 experts as an nn.ModuleList: under ep each rank holds 2 (compiler/expert_lists.py)
        from adaptdist.models.moe import MoEModel

        return MoEModel(16, 32, 4, 2, experts="list", combine="index_add")
    if kind == "gpt":
        from adaptdist.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(dim=32, num_layers=2, num_heads=4, max_seq_len=8))
    return Small()


def backend_for(case: dict):
    """The adaptdist backend of a case: its plan (tp presets with the GPT's globs) and mesh."""
    from backend_workers import make_plan

    kind = case.get("model", "small")
    if kind == "moe-list" and case["plan"] == "ep":
        from adaptdist.annotations import ManualPlan
        from adaptdist.models import moe

        return adaptdist.backend(plan=ManualPlan.parse("ep", moe))
    return adaptdist.backend(plan=make_plan("gpt" if kind == "gpt" else kind, case["plan"]), mesh=case.get("mesh"))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    raise ValueError(kind)


def batch(step: int, kind: str = "small", rows: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "moe-list":
        return torch.randn(rows, 3, 16, generator=g), torch.randn(rows, 3, 16, generator=g)
    if kind == "gpt":
        return torch.randint(0, 256, (rows, 8), generator=g), torch.randint(0, 256, (rows, 8), generator=g)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 4, (rows,), generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.is_floating_point():  # moe-list: regression
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def train_step(model, opt, step: int, rank: int, world: int, kind: str = "small", rows: int = GLOBAL_BATCH) -> float:
    x, y = batch(step, kind, rows)
    loss = loss_of(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def full(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a parameter, or a state tensor of parameter ``like``) as the full tensor (all_gathered where
    ``like`` holds a shard: a collective)."""
    layout = getattr(like, "_adaptdist_layout", None)
    whole_or_none = getattr(layout, "whole_or_none", False)  # a ModuleList expert: whole on some ranks, gathered on all
    if layout is None or tuple(t.shape) != tuple(like.shape) or (
            tuple(like.shape) == tuple(layout.global_shape) and not whole_or_none):
        return t.detach().clone()
    return layout.gather(t.detach())


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """Full parameters, full optimizer state ({name: {key: tensor or number}}) and param groups' lr."""
    inner = getattr(model, "_orig_mod", model)
    named = list(inner.named_parameters())
    params = {n: full(p.data, p) for n, p in named}
    state = {}
    if opt is not None:
        for n, p in named:
            state[n] = {k: (full(v, p) if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
    layouts = {n: getattr(p, "_adaptdist_layout").ranges for n, p in named if getattr(p, "_adaptdist_layout", None)}
    return {"params": params, "state": state, "layouts": layouts,
            "lr": [g["lr"] for g in opt.param_groups] if opt is not None else []}


def _init(timeout_s: float) -> tuple[int, int]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return int(os.environ["RANK"]), dist.get_world_size()


def save_worker(cases: list[dict], timeout_s: float = 120.0) -> list[dict]:
    """Per case (root, plan, opt, save_at, steps): train ``save_at`` steps, save, snapshot ("saved"), train on
    to ``steps`` ("final": the uninterrupted run). One process group for all cases."""
    rank, world = _init(timeout_s)
    try:
        out = []
        for case in cases:
            kind, rows = case.get("model", "small"), case.get("rows", GLOBAL_BATCH)
            model = make_model(0, kind)
            opt = make_optimizer(model, case["opt"])
            compiled = torch.compile(model, backend=backend_for(case), fullgraph=True)
            for s in range(case["save_at"]):
                train_step(compiled, opt, s, rank, world, kind, rows)
            adaptdist.save_checkpoint(case["root"], compiled, opt, step=case["save_at"], extra={"plan": case["plan"]},
                                      keep=2)
            saved = snapshot(compiled, opt)
            for s in range(case["save_at"], case["steps"]):
                train_step(compiled, opt, s, rank, world, kind, rows)
            out.append({"saved": saved, "final": snapshot(compiled, opt)})
        return out
    finally:
        dist.destroy_process_group()


def load_worker(cases: list[dict], timeout_s: float = 120.0) -> list[dict]:
    """Per case (root, plan, opt, order, steps): a fresh model of other initial weights and a fresh optimizer;
    with order "after", one compiled forward/backward first (the parameters become shards; no step), with
    "before" none; load; snapshot ("loaded"); train from the loaded step to ``steps`` ("final"); with
    ``save_to``, save there at ``steps``."""
    rank, world = _init(timeout_s)
    try:
        return _load_cases(cases, rank, world)
    finally:
        dist.destroy_process_group()


def _load_cases(cases: list[dict], rank: int, world: int) -> list[dict]:
    """The body of :func:`load_worker`, in a process group already started."""
    out = []
    for case in cases:
        kind, rows = case.get("model", "small"), case.get("rows", GLOBAL_BATCH)
        model = make_model(1, kind)
        opt = make_optimizer(model, case["opt"])
        compiled = torch.compile(model, backend=backend_for(case), fullgraph=True)
        if case["order"] == "after":
            x, y = batch(0, kind, rows)
            loss_of(compiled(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.zero_grad(set_to_none=True)
        step, extra = adaptdist.load_checkpoint(case["root"], compiled, opt)
        loaded = snapshot(compiled, opt)
        for s in range(step, case["steps"]):
            train_step(compiled, opt, s, rank, world, kind, rows)
        if case.get("save_to"):  # saved again from this world's shards (empty ones included)
            adaptdist.save_checkpoint(case["save_to"], compiled, opt, step=case["steps"])
        out.append({"step": step, "extra": extra, "loaded": loaded, "final": snapshot(compiled, opt)})
    return out


def _other_model_error(root: str) -> str:
    model = nn.Sequential(nn.Linear(12, 5))
    try:
        adaptdist.load_checkpoint(root, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def load_then_other_model_worker(cases: list[dict], root: str, timeout_s: float = 120.0) -> tuple[list[dict], str]:
    """:func:`load_worker`'s cases, then :func:`other_model_worker` on ``root``, in one process group (one
    launch for two tests' checks)."""
    rank, world = _init(timeout_s)
    try:
        return _load_cases(cases, rank, world), _other_model_error(root)
    finally:
        dist.destroy_process_group()
