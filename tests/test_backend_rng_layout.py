"""adaptdist.backend(rng="global") on random draws whose batch is not dim 0 (compiler/eager_batch.py,
passes/global_rng.py).

The backend's joint graph draws ``[W, *s]`` (rank dim first); one process on the whole batch draws ``s`` with the
batch ``W`` times larger. A tester found dropout on a time-major ``[L, B, D]`` activation trained differently from
eager (losses 0.939 vs 0.930): the whole ``[W, L, b, D]`` tensor was drawn in rank-major order. The fast tests
run the backend's capture and lowering on simulated ranks (one process, each rank its own generator, all seeded
alike) and compare with eager on the whole batch; the slow one runs 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
from adaptdist.compiler.eager_batch import EAGER_BATCH, UNKNOWN, batch_locations
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.lowering_options import LoweringOptions
from adaptdist.runtime.simulate import simulate_ranks

SEED, L, ROWS = 7, 5, 3  # rows per rank


class Layouts(nn.Module):
    """A conv then a time-major ``[L, B, 8]`` activation (strictly positive, so dropout's output is 0 exactly
    where its mask is), and one random draw on it laid out as ``kind`` says; returns the drawn-on value."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 8, (3, 1), padding=(1, 0))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # x [B, 3, L, 1]
        h = F.relu(self.conv(x)).squeeze(-1).permute(2, 0, 1)  # [L, B, 8]
        h = torch.sigmoid(self.lin(h)) + 0.1
        if self.kind == "time_major":  # the tester's drop_tbd: batch on dim 1
            return F.dropout(h, 0.3, True)
        if self.kind == "flat_time_major":  # [L * B, 8]: the batch an inner factor of dim 0
            return F.dropout(h.reshape(-1, 8), 0.3, True)
        if self.kind == "batch_first":  # [B, L, 8]: the case that was already right
            return F.dropout(h.transpose(0, 1).contiguous(), 0.3, True)
        if self.kind == "strided_batch_first":  # [B, L, 8] not contiguous: CPU dropout fills it in memory order
            return F.dropout(h.transpose(0, 1), 0.3, True)
        if self.kind == "strided_batch_last":  # [L, 8, B] not contiguous, the batch on dim 2
            return F.dropout(h.transpose(1, 2), 0.3, True)
        if self.kind == "rand_like":  # noise drawn in memory order on a contiguous [L, B, 8]
            return h + torch.rand_like(h)
        if self.kind == "two_draws":  # the generator must advance as eager's between draws
            return F.dropout(h, 0.3, True) + torch.randn_like(h)
        raise ValueError(self.kind)


def _backend_on_simulated_ranks(model: nn.Module, x: torch.Tensor, world: int):
    """The backend's capture of ``model`` on ``world`` ranks' rows of ``x`` (rng="global"), lowered for dp and run on
    simulated ranks seeded SEED: (the stacked forward output ``[W, *one rank's]``, rank 0's generator state after,
    every rank's state equal?, the joint graph's random-op annotations)."""
    seen = {}

    def capture_only(gm, example_inputs):
        seen["cg"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), world, rng="global")
        return gm.forward

    torch._dynamo.reset()
    rows = x.shape[0] // world
    torch.compile(model, backend=capture_only, dynamic=False)(x[:rows])
    cg = seen["cg"]
    notes = [n.meta[EAGER_BATCH] for n in cg.gm.graph.nodes if EAGER_BATCH in n.meta]
    named = dict(model.named_parameters())
    progs = lower(cg, resolve_plan(ManualPlan.parse("dp"), cg, world), LoweringOptions(rng="global", debug=True),
                  state={f: named[f].detach().clone() for f in cg.input_fqns})
    stacked = x.view(world, rows, *x.shape[1:])
    out_shape = model(x[:rows]).shape
    tangent = torch.ones(world, *out_shape)
    torch.manual_seed(SEED)
    states = [torch.get_rng_state() for _ in range(world)]
    ins = [[named[f].detach() for f in p.input_fqns] + list(p.local_batch((stacked, tangent))) for p in progs.values()]
    outs = simulate_ranks([p.module for p in progs.values()], ins, rng_states=states)
    k = progs[0].output_roles.index("out:0")
    return torch.cat([o[k] for o in outs]), states[0], all(torch.equal(s, states[0]) for s in states), notes


def _eager(model: nn.Module, x: torch.Tensor):
    torch.manual_seed(SEED)
    out = model(x).detach()
    return out, torch.get_rng_state()


def _as_ranks(out: torch.Tensor, kind: str, world: int) -> torch.Tensor:
    """Eager's output on the whole batch as the backend stacks it: ``[W, *one rank's]``."""
    if kind in ("batch_first", "strided_batch_first"):
        return out.reshape(world, ROWS, *out.shape[1:])
    if kind == "strided_batch_last":
        return out.reshape(L, 8, world, ROWS).permute(2, 0, 1, 3)
    if kind == "flat_time_major":
        return out.view(L, world, ROWS, 8).permute(1, 0, 2, 3).reshape(world, L * ROWS, 8)
    return out.view(L, world, ROWS, 8).permute(1, 0, 2, 3)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["time_major", "flat_time_major", "batch_first", "strided_batch_first",
                                  "strided_batch_last", "rand_like", "two_draws"])
def test_backend_global_draws_equal_eager_whatever_the_batch_dim(kind, world):
    """Every element's random number equals single-process eager's on the whole batch (dropout masks bit for bit,
    values to float rounding), and every rank's generator ends where eager's does. Before the fix, all but
    batch_first drew the same numbers on other elements (CPU's bernoulli_ fills a permuted tensor in memory
    order: strided_batch_first was wrong with the batch on dim 0 too)."""
    torch.manual_seed(0)
    model = Layouts(kind)
    x = torch.randn(world * ROWS, 3, L, 1, generator=torch.Generator().manual_seed(1))
    got, end, same, notes = _backend_on_simulated_ranks(model, x, world)
    ref, ref_end = _eager(model, x)
    want = _as_ranks(ref, kind, world)
    if kind != "rand_like":
        mask_got, mask_want = got != 0, want != 0
        if kind == "two_draws":
            mask_got, mask_want = None, None
        else:
            assert torch.equal(mask_got, mask_want), f"{int((mask_got != mask_want).sum())} mask elements differ"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert same and torch.equal(end, ref_end)
    expected = {"time_major": (1, 1, ROWS), "flat_time_major": (0, L, ROWS), "batch_first": (0, 1, ROWS),
                "strided_batch_first": (0, 1, ROWS), "strided_batch_last": (2, 1, ROWS),
                "rand_like": (1, 1, ROWS), "two_draws": (1, 1, ROWS)}[kind]
    assert notes and all(n == expected for n in notes), notes


def _locations(fn, *args, user=(True,)):
    traced = make_fx(fn)(*args)
    return batch_locations(traced, list(user) + [False] * (len(args) - len(user)))


def test_batch_locations_follow_views_permutes_matmuls_and_reductions():
    """One rank's ATen graph: the batch factor's (dim, outer, rows) at each random op, followed from dim 0 of the
    user input; a reduction over the rows makes it unknown (that value is per rank, not eager's)."""
    x, w = torch.randn(3, 5, 8), torch.randn(8, 8)

    def f(x, w):
        t = x.permute(1, 0, 2)  # [5, 3, 8]: batch on dim 1
        a = F.dropout(t @ w, 0.5, True)
        b = torch.rand_like(t.reshape(15, 8))  # [15, 8]: outer 5
        c = torch.randn_like(x.reshape(24, 5)[:, :2])  # a slice of the rows' dim: unknown
        d = torch.rand_like(t.mean(1))  # reduced over the rows: unknown
        e = torch.rand_like(x.unsqueeze(0).expand(2, 3, 5, 8))  # expand: batch on dim 1
        q, k = (x @ w).split(4, dim=-1)  # attention: scores [3, 5, 5] softmaxed on the last dim
        s = torch.softmax(q @ torch.cat([torch.zeros(3, 4, 0), k.transpose(1, 2)], -1), -1)
        return a, b, c, d, e, F.dropout(s, 0.1, True)

    assert _locations(f, x, w) == [(1, 1, 3), (0, 5, 3), UNKNOWN, UNKNOWN, (1, 1, 3), (0, 1, 3)]


def test_a_draw_whose_rows_cannot_be_followed_is_named_in_a_warning(caplog):
    """A random op on a value reduced over the rows (its batch location unknown) keeps the rank-major draw, and the
    capture says so, naming it: never a silently different number."""

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):  # x [B, 5, 8]
            h = self.lin(x)
            return h + torch.rand_like(h.mean(0))

    def capture_only(gm, example_inputs):
        capture_all_ranks(gm, classify_inputs(gm, example_inputs), 2, rng="global")
        return gm.forward

    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="adaptdist.compiler"):
        torch.compile(Pooled(), backend=capture_only, dynamic=False)(torch.randn(3, 5, 8))
    assert any("cannot tell where the batch rows are in the random draws" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("plan,world", [("dp", 2), ("fsdp", 3)])
def test_backend_time_major_dropout_on_gloo_equals_eager(plan, world):
    """The tester's drop_tbd on real gloo ranks through torch.compile(backend=adaptdist.backend(plan, rng='global')),
    every rank seeded alike: losses of 3 SGD steps, the first step's gradients (dp) and the parameters after them
    equal single-process eager's on the whole batch; every rank's generator ends where eager's does."""
    from adaptdist.runtime.launch import launch_local
    from rng_workers import backend_time_major_worker, time_major_and_batch

    steps, lr, rows = 3, 0.1, 2
    results = launch_local(backend_time_major_worker, (rows, steps, lr, SEED, plan), world)
    model, x, y = time_major_and_batch(rows * world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(SEED)
    losses, grads = [], None
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    end = torch.get_rng_state()
    for r in range(world):
        assert results[r]["losses"] == pytest.approx(losses, abs=1e-5), (r, results[r]["losses"], losses)
        for f, g in results[r]["grads"].items():
            torch.testing.assert_close(g, grads[f], atol=1e-5, rtol=1e-5, msg=f"rank {r} grad {f}")
        for f, p in model.state_dict().items():
            torch.testing.assert_close(results[r]["params"][f], p, atol=1e-5, rtol=1e-5, msg=f"rank {r} {f}")
        assert torch.equal(results[r]["rng"], end), r


class TransposedDrop(nn.Module):
    """Dropout of a transposed activation ``[B, L, 8]`` (not contiguous: memory order L, B, 8)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)

    def forward(self, x):  # x [B, L, 6]
        h = torch.sigmoid(self.a(x.transpose(0, 1))) + 0.1  # [L, B, 8]
        return F.dropout(h.transpose(0, 1), 0.4, True)


@pytest.mark.parametrize("world", [2, 3])
def test_adaptdist_train_global_dropout_of_a_transposed_activation_equals_eager(world):
    """adaptdist train's capture (the whole batch, one process's shapes) with rng="global" on simulated ranks: CPU's
    dropout fills a transposed activation's mask in memory order; functional bernoulli.p draws contiguous, so the
    mask (and the gradient) differed from eager's before; now the gradient equals eager's."""
    from adaptdist.compiler.capture import capture

    torch.manual_seed(0)
    model = TransposedDrop()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * world, 5, 6, generator=g), torch.randn(2 * world, 5, 8, generator=g)
    cg = capture(model, (x, y), F.mse_loss)
    named = dict(model.named_parameters())
    progs = lower(cg, resolve_plan(ManualPlan.parse("dp"), cg, world), LoweringOptions(rng="global", debug=True),
                  state={f: named[f].detach().clone() for f in cg.input_fqns})
    torch.manual_seed(SEED)
    states = [torch.get_rng_state() for _ in range(world)]
    ins = [[named[f].detach() for f in p.input_fqns] + list(p.local_batch((x, y))) for p in progs.values()]
    outs = simulate_ranks([p.module for p in progs.values()], ins, rng_states=states)
    torch.manual_seed(SEED)
    want = torch.autograd.grad(F.mse_loss(model(x), y), model.a.weight)[0]
    k = progs[0].output_roles.index("grad:a.weight")
    for r in range(world):
        torch.testing.assert_close(outs[r][k], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(states[0], torch.get_rng_state())
