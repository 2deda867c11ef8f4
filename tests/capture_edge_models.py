"""Small models for the capture edge cases (tests/test_capture_edge_cases.py), each ``(model, batch, loss_fn)``
with ``batch = (x, y)``; importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearTwice(nn.Module):
    """One ``nn.Linear`` under two names (``self.b = self.a``), applied twice: one parameter, two uses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = self.a
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SharedWeight(nn.Module):
    """One weight assigned to two modules (an embedding and its output head), the first name read only
    through the second module (like HF T5's ``shared``/``embed_tokens``)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(11, 6)
        self.embed = nn.Embedding(11, 6)
        self.embed.weight = self.shared.weight
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


class FrozenBlock(nn.Module):
    """A frozen first block (``requires_grad=False``) before a trainable one."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.frozen.requires_grad_(False)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.frozen(x))


class ShapeBranch(nn.Module):
    """A Python branch on a parameter's shape: tanh when ``a`` is wide (8 outputs), sigmoid when not."""

    def __init__(self, wide: bool):
        super().__init__()
        self.a = nn.Linear(6, 8 if wide else 4)
        self.b = nn.Linear(self.a.out_features, 3)

    def forward(self, x):
        h = self.a(x)
        if self.a.weight.shape[0] > 4:
            h = torch.tanh(h)
        else:
            h = torch.sigmoid(h)
        return self.b(h)


class DataBranch(nn.Module):
    """A Python branch on data: tanh when the activations sum above 0, else 2 * relu."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = torch.tanh(h)
        else:
            h = torch.relu(h) * 2
        return self.b(h)


class UnusedHead(nn.Module):
    """Parameters the loss does not reach (DDP's find_unused_parameters): a pooler whose output the forward
    computes and drops (dead code in the graph), and a head it never calls."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.pooler = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        pooled = torch.tanh(self.pooler(h))  # computed, not in the loss (as BertModel's pooler under a token loss)
        del pooled
        return self.out(h)


def _dense(model: nn.Module, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)), F.mse_loss


def linear_twice(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    return _dense(LinearTwice(), batch, seed)


def shared_weight(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 11, (batch, 5), generator=g)
    return SharedWeight(), (ids, (ids * 3 + 1) % 11), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())


def frozen_block(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    return _dense(FrozenBlock(), batch, seed)


def unused_head(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    return _dense(UnusedHead(), batch, seed)


def shape_branch(batch: int = 6, seed: int = 0, wide: bool = True):
    torch.manual_seed(seed)
    return _dense(ShapeBranch(wide), batch, seed)


def data_branch(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    return _dense(DataBranch(), batch, seed)


FACTORIES = {
    "linear_twice": linear_twice,
    "shared_weight": shared_weight,
    "frozen_block": frozen_block,
    "unused_head": unused_head,
    "shape_wide": lambda batch: shape_branch(batch, wide=True),
    "shape_narrow": lambda batch: shape_branch(batch, wide=False),
}


def backend_edge_worker(cases: list[dict], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    """Each case (model, plan, global batch) for ``steps`` SGD steps through ``torch.compile(model,
    backend=adaptdist.backend(plan=...))``, each rank on its rows of the global batch (DDP's contract): per
    step the loss and the full gradient of every parameter (None for a frozen one), then
    ``adaptdist.full_state_dict``, the parameters the optimizer was given (by name) and, for each compiled
    graph, the parameters it sharded and the collectives it runs."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import adaptdist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        out = []
        for case in cases:
            if case["model"] == "divergent_branch":
                out.append(_divergent_branch(rank, adaptdist))
                continue
            model, batch, loss_fn = FACTORIES[case["model"]](case["batch"])
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
            be = adaptdist.backend(plan=case["plan"])
            compiled = torch.compile(model, backend=be, fullgraph=True)
            x, y = (t.chunk(world)[rank] for t in batch)
            losses, grads = [], []
            for _ in range(steps):
                loss = loss_fn(compiled(x), y)
                loss.backward()
                losses.append(loss.item())
                grads.append({n: _full_grad(p) for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
            out.append({"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled),
                        "collectives": [s.collectives() for s in be.compiled],
                        "sharded": sorted(n for n, p in model.named_parameters()
                                          if getattr(p, "_adaptdist_layout", None) is not None)})
        return out
    finally:
        dist.destroy_process_group()


def _divergent_branch(rank: int, adaptdist) -> dict:
    """DataBranch under dp, rank 0's rows taking the tanh side and rank 1's the relu side: the error text."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DataBranch()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(7)) * (10.0 if rank == 0 else -10.0)
    with torch.no_grad():
        side = bool(model.a(x).sum() > 0)
    try:
        torch.compile(model, backend=adaptdist.backend(plan="dp"))(x).pow(2).mean().backward()
        return {"side": side, "error": None}
    except Exception as e:  # Dynamo wraps the backend's error
        return {"side": side, "error": f"{type(e).__name__}: {e}"}


def _full_grad(p: torch.Tensor):
    if p.grad is None:
        return None
    layout = getattr(p, "_adaptdist_layout", None)
    return p.grad.clone() if layout is None else layout.gather(p.grad)
