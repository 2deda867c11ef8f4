"""Small mixture-of-experts (MoE) models, written as users write them (our own, no downloads).

A top-k router (``torch.topk`` over the softmax of a linear gate) sends each token to ``k`` of ``E``
experts; the experts' outputs are combined with the router's weights. The forms:

- ``experts="list"``: an ``nn.ModuleList`` of small MLPs (``d -> hidden -> d``).
- ``experts="stacked"``: one stacked weight per layer, ``w_in: [E, d, hidden]`` and ``w_out: [E, hidden, d]``,
  the form expert parallelism shards (``EP_PLAN``: dim 0, the expert dim, split over the ``ep`` mesh axis).

``dispatch`` says how tokens reach their experts:

- ``"dense"`` (static shapes, every plan): every expert runs on every token and the router's weight of
  (token, expert) is zero where the router did not pick that expert, so a masked slot gets no gradient.
  ``combine="scatter_add"`` builds the ``[N, E]`` weights with ``scatter_add`` (over dim 1, the experts),
  ``combine="index_add"`` with ``index_add`` over the transposed ``[E, N]`` weights (``index_add`` along the
  expert dim), ``combine="mask"`` with ``(idx == e)`` masks.
- ``"where"`` (Mixtral's loop): ``tok, slot = torch.where(idx == e)`` per expert, ``out.index_add_(0, tok,
  expert(x[tok]) * w[tok, slot])``. The token counts per expert depend on the data (``nonzero``), which
  adaptdist cannot compile: the torch.compile backend breaks the graph there (each expert then runs
  eagerly, undistributed) and ``adaptdist train`` refuses it with a CaptureError naming the construct.

``factory(batch_size, ...)`` follows the adaptdist model contract: ``(model, (x, y), loss_fn)`` with
``x: float32[batch_size, seq_len, d]``, ``y`` alike, and ``loss_fn`` the mean squared error.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# `--plan ep` (a one-axis mesh named ep, the batch split on it as under dp): the stacked experts'
# weights split on their expert dim, so each rank holds E/ep experts; tokens reach them by all_to_all.
EP_PLAN = {
    "moe.w_in": "S(0)",
    "moe.w_out": "S(0)",
}


class TopKRouter(nn.Module):
    """gates = softmax(x @ W_g), (weights, experts) = topk(gates, k), weights renormalised over the k.

    Shapes: x ``[N, d]`` -> weights ``float[N, k]``, experts ``int64[N, k]``.
    """

    def __init__(self, d: int, n_experts: int, k: int):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gates = F.softmax(self.gate(x), dim=-1)
        w, idx = torch.topk(gates, self.k, dim=-1)
        return w / w.sum(-1, keepdim=True), idx


class ExpertMLP(nn.Module):
    """One expert of the ModuleList form: ``x [N, d] -> out(gelu(fc(x))) [N, d]``, hidden width ``hidden``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


def combine_weights(w: torch.Tensor, idx: torch.Tensor, n_experts: int, combine: str) -> torch.Tensor:
    """The router's weight of every (token, expert): ``[N, E]``, zero where the expert was not picked.

    ``w``, ``idx``: ``[N, k]``. ``combine``: ``"scatter_add"``, ``"index_add"`` or ``"mask"`` (same values).
    """
    n, k = w.shape
    if combine == "scatter_add":
        return torch.zeros(n, n_experts, dtype=w.dtype).scatter_add(1, idx, w)
    if combine == "index_add":
        # one index_add per routing slot, along the expert dim of the [E, N] weights: slot j of token t
        # adds w[t, j] at row idx[t, j], written with a one-hot of the slot's experts
        experts = torch.arange(n_experts)
        g = torch.zeros(n_experts, n, dtype=w.dtype)
        for j in range(k):
            onehot = (idx[:, j:j + 1] == experts).to(w.dtype)  # [N, E]
            g = g.index_add(0, experts, (onehot * w[:, j:j + 1]).t())
        return g.t()
    if combine == "mask":
        return torch.stack([(w * (idx == e)).sum(-1) for e in range(n_experts)], dim=-1)
    raise ValueError(f"combine={combine!r}: use scatter_add, index_add or mask")


class MoELayer(nn.Module):
    """One MoE feed-forward layer: ``x [N, d] -> [N, d]`` (see the module docstring for the forms)."""

    def __init__(self, d: int, hidden: int, n_experts: int, k: int, experts: str = "list",
                 dispatch: str = "dense", combine: str = "scatter_add"):
        super().__init__()
        if experts not in ("list", "stacked") or dispatch not in ("dense", "where"):
            raise ValueError(f"experts={experts!r} (list|stacked), dispatch={dispatch!r} (dense|where)")
        self.router = TopKRouter(d, n_experts, k)
        self.n_experts, self.form, self.dispatch, self.combine = n_experts, experts, dispatch, combine
        if experts == "list":
            self.experts = nn.ModuleList(ExpertMLP(d, hidden) for _ in range(n_experts))
        else:
            self.w_in = nn.Parameter(torch.randn(n_experts, d, hidden) / d ** 0.5)
            self.w_out = nn.Parameter(torch.randn(n_experts, hidden, d) / hidden ** 0.5)

    def _expert_all(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on every token: ``[E, N, d]``."""
        if self.form == "stacked":  # a batched matmul over the expert dim
            xe = x.unsqueeze(0).expand(self.n_experts, -1, -1)  # [E, N, d]
            return torch.bmm(F.gelu(torch.bmm(xe, self.w_in)), self.w_out)
        return torch.stack([e(x) for e in self.experts])

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.form == "stacked":
            return F.gelu(x @ self.w_in[e]) @ self.w_out[e]
        return self.experts[e](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x)
        if self.dispatch == "where":
            out = torch.zeros_like(x)
            for e in range(self.n_experts):
                tok, slot = torch.where(idx == e)
                out.index_add_(0, tok, self._expert(e, x[tok]) * w[tok, slot, None])
            return out
        g = combine_weights(w, idx, self.n_experts, self.combine)  # [N, E]
        y = self._expert_all(x)  # [E, N, d]
        return (g.t().unsqueeze(-1) * y).sum(0)  # [E, N, 1] * [E, N, d] summed over the experts


class MoEModel(nn.Module):
    """x ``[B, T, d]`` -> ``[B, T, d]``: input projection, one MoE layer (residual), output projection."""

    def __init__(self, d: int = 16, hidden: int = 32, n_experts: int = 4, k: int = 2, **form):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.moe = MoELayer(d, hidden, n_experts, k, **form)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.inp(x).reshape(b * t, d)
        h = h + self.moe(h)
        return self.head(h).reshape(b, t, d)


def factory(batch_size: int = 4, seq_len: int = 6, d: int = 16, hidden: int = 32, n_experts: int = 4, k: int = 2,
            seed: int = 0, **form):
    """``(model, (x, y), mse_loss)``; ``form``: ``experts`` (default ``"stacked"``, which ``--plan ep`` shards),
    ``dispatch`` (``"dense"``), ``combine`` (``"scatter_add"``); see the module."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = MoEModel(d, hidden, n_experts, k, **{"experts": "stacked", **form})
    x = torch.randn(batch_size, seq_len, d, generator=g)
    y = torch.randn(batch_size, seq_len, d, generator=g)
    return model, (x, y), F.mse_loss


def list_factory(batch_size: int = 4, seq_len: int = 6, **kw):
    """:func:`factory` with the experts as an ``nn.ModuleList`` of MLPs, combined by ``index_add``."""
    return factory(batch_size, seq_len, **{"experts": "list", "combine": "index_add", **kw})
