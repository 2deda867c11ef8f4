"""nn.EmbeddingBag under dp, fsdp and auto (issue 14, point 4): bags of one length keep the batch split and
equal eager (loss, gradients, parameters after SGD steps); other forms gather their inputs, correctly."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passutil import simulated_sgd
from reference import eager_sgd

LR, STEPS = 0.5, 2


class Bag(nn.Module):
    def __init__(self, mode: str = "mean", weighted: bool = False):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode=mode)
        self.fc = nn.Linear(8, 3)
        self.weighted = weighted

    def forward(self, x, w=None):
        return self.fc(self.bag(x, per_sample_weights=w) if self.weighted else self.bag(x))


def bag_model(batch_size: int = 6, mode: str = "mean", weighted: bool = False, grad_weights: bool = False):
    torch.manual_seed(0)
    model = Bag(mode, weighted)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (batch_size, 4), generator=g)
    y = torch.randint(0, 3, (batch_size,), generator=g)
    if weighted:
        w = torch.rand(batch_size, 4, generator=g).requires_grad_(grad_weights)
        return model, (x, w, y), F.cross_entropy
    return model, (x, y), F.cross_entropy


def _lowered_sgd(model, batch, loss_fn, plan: str, world: int = 2, **opts):
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, world, plan, LR, STEPS, **opts)
    return progs, hist, params


def _assert_equal_eager(model, batch, loss_fn, hist, params, atol=1e-5):
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, LR, STEPS)
    for (gl, gg), (wl, wg) in zip(hist, want_hist):
        assert abs(gl - wl) < atol
        for f in wg:
            assert torch.allclose(gg[f], wg[f], atol=atol), (f, (gg[f] - wg[f]).abs().max())
    for f, p in want_params.items():
        assert torch.allclose(params[f], p, atol=atol), (f, (params[f] - p).abs().max())


@pytest.mark.parametrize("plan,mode,batch_size", [("dp", "mean", 6), ("fsdp", "mean", 6), ("dp", "sum", 5),
                                                  ("fsdp", "sum", 5), ("auto", "mean", 6)])
def test_bags_of_one_length_keep_the_batch_split_and_equal_eager(plan, mode, batch_size):
    model, batch, loss_fn = bag_model(batch_size, mode)
    progs, hist, params = _lowered_sgd(model, batch, loss_fn, plan)
    _assert_equal_eager(model, batch, loss_fn, hist, params)
    code = progs[0].graph_module.code
    assert "_embedding_bag" not in code and "embedding" in code
    if plan == "dp":  # no index is gathered: only the loss and the gradients are all-reduced
        assert all("all_reduce" in c for c in progs[0].collectives())


def test_per_sample_weights():
    model, batch, loss_fn = bag_model(6, "sum", weighted=True)
    _, hist, params = _lowered_sgd(model, batch, loss_fn, "fsdp")
    _assert_equal_eager(model, batch, loss_fn, hist, params)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_replicate_fallback_and_max_mode_work(plan):
    # max mode is not rewritten: its rule gathers the inputs (no --replicate-fallback needed), and the fallback
    # on the rewritten form changes nothing
    for mode, fallback in (("max", False), ("mean", True)):
        model, batch, loss_fn = bag_model(6, mode)
        _, hist, params = _lowered_sgd(model, batch, loss_fn, plan, replicate_fallback=fallback)
        _assert_equal_eager(model, batch, loss_fn, hist, params)



class DLRM(nn.Module):
    """A DLRM-style recommender: dense features and two EmbeddingBags, concatenated, an MLP on top, a logit."""

    def __init__(self, mode: str = "sum", padding_idx=None):
        super().__init__()
        self.dense = nn.Linear(5, 8)
        self.a = nn.EmbeddingBag(40, 8, mode=mode, padding_idx=padding_idx)
        self.b = nn.EmbeddingBag(30, 8, mode=mode)
        self.top = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, d, ia, ib):
        return self.top(torch.cat([self.dense(d), self.a(ia), self.b(ib)], 1)).squeeze(1)


@pytest.mark.parametrize("mode,padding_idx,plan,fallback", [("sum", None, "dp", True), ("sum", None, "fsdp", True),
                                                            ("max", None, "fsdp", False), ("sum", 0, "dp", False)])
def test_recommender_with_bce_logits_and_replicate_fallback(mode, padding_idx, plan, fallback):
    """The issue's recommender with --replicate-fallback ended in an InternalError (dp) or a raw IndexError (fsdp):
    binary_cross_entropy_with_logits captured without its optional weight arguments."""
    torch.manual_seed(0)
    model = DLRM(mode, padding_idx)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 5, generator=g), torch.randint(0, 40, (6, 3), generator=g),
             torch.randint(0, 30, (6, 2), generator=g), torch.rand(6, generator=g))
    loss_fn = F.binary_cross_entropy_with_logits
    _, hist, params = _lowered_sgd(model, batch, loss_fn, plan, replicate_fallback=fallback)
    _assert_equal_eager(model, batch, loss_fn, hist, params)


BACKEND_CASES = [dict(model="bag_sum", plan="fsdp"),
                 dict(model="convnet_nostats", plan="dp")]  # with running statistics: test_batch_norm.py


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_embedding_bag_and_batch_norm_through_the_backend_on_gloo():
    """Real gloo ranks through torch.compile(backend=adaptdist.backend(...)): each rank's loss on its rows and the
    gradients of the ranks' mean loss equal eager's (DDP's semantics: BatchNorm without running statistics takes
    each rank's own statistics)."""
    from adaptdist.runtime.launch import launch_local
    from bn_workers import backend_cases_worker, factory

    world, steps, lr = 2, 2, 0.5
    results = launch_local(backend_cases_worker, (BACKEND_CASES, steps, lr), world)
    for k, case in enumerate(BACKEND_CASES):
        model, batch, loss_fn = factory(case["model"])
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for s in range(steps):
            rows = list(zip(*(t.chunk(world) for t in batch)))
            losses = [loss_fn(model(x), y) for x, y in rows]
            (sum(losses) / world).backward()
            for r in range(world):
                got = results[r][k]
                assert "error" not in got, got
                assert abs(got["losses"][s] - losses[r].item()) < 1e-5, (case, r, s)
                for n, p in model.named_parameters():
                    torch.testing.assert_close(got["grads"][s][n], p.grad, atol=1e-5, rtol=0, msg=f"{case} {r} {s} {n}")
            opt.step()
            opt.zero_grad()
        for r in range(world):
            for n, p in model.named_parameters():
                torch.testing.assert_close(results[r][k]["params"][n], p.detach(), atol=1e-5, rtol=0)
