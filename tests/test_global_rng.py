"""rng="global" (passes/global_rng.py): random ops draw what one process draws on the whole batch.

Simulated ranks (runtime/simulate.py, each rank with its own generator state, all seeded alike): dropout masks
equal single-process eager bit for bit, and parameters after SGD steps equal eager's to 1e-6, on 1, 2 and 3 ranks
(7 rows: uneven shards on 2 and 3). The default, rng="per-rank", keeps DDP's behaviour (masks depend on the
ranks). Real gloo runs of the backend and of ``adaptdist train`` are in the slow tests at the end.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.errors import UsageError
from adaptdist.lowering_options import LoweringOptions
from adaptdist.runtime.simulate import simulate_ranks

aten = torch.ops.aten
SEED, STEPS, LR, P = 1234, 3, 0.5, 0.4


class NoisyMLP(nn.Module):
    """Dropout on a strictly positive activation (so its output is 0 exactly where the mask is), a randn_like
    noise and a rand of the batch's shape: every kind of random op the joint graph holds."""

    def __init__(self, d_in: int = 6, hidden: int = 24, d_out: int = 3):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.drop = nn.Dropout(P)
        self.b = nn.Linear(hidden, d_out)

    def forward(self, x):
        h = self.drop(torch.sigmoid(self.a(x)) + 0.1)
        h = h + 0.05 * torch.randn_like(h) + 0.05 * torch.rand(x.shape[0], h.shape[1])
        return self.b(h)


def _model_and_batches(rows: int = 7):
    torch.manual_seed(0)
    model = NoisyMLP()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]
    return model, batches


def _eager(model, batches):
    """Single-process eager SGD from generator state SEED: (masks per step, final parameters)."""
    model = copy.deepcopy(model)
    masks = []
    hook = model.drop.register_forward_hook(lambda m, i, o: masks.append(o != 0))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(SEED)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    hook.remove()
    return masks, {n: p.detach().clone() for n, p in model.named_parameters()}


def _expose_masks(gm: torch.fx.GraphModule) -> None:
    """Append every dropout mask the program's backward reads to its outputs (for the test only)."""
    masks = [n.args[1] for n in gm.graph.nodes if n.target is aten.native_dropout_backward.default]
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]) + tuple(masks),)
    gm.recompile()


def _simulate_sgd(model, batches, world: int, rng: str):
    """SGD on ``world`` simulated ranks (every rank seeded SEED): (each step's global mask, final parameters)."""
    x0, y0 = batches[0]
    cg = capture(model, (x0, y0), F.mse_loss)
    plan = resolve_plan(ManualPlan.parse("dp"), cg, world)
    named = dict(model.named_parameters())
    progs = lower(cg, plan, LoweringOptions(rng=rng), state={f: named[f].detach().clone() for f in cg.input_fqns})
    for p in progs.values():
        _expose_masks(p.module)
    params = {f: named[f].detach().clone() for f in cg.param_fqns}
    torch.manual_seed(SEED)
    states = [torch.get_rng_state() for _ in range(world)]
    n_out = len(progs[0].output_roles)
    masks = []
    for x, y in batches:
        ins = [[params[f] for f in p.input_fqns] + list(p.local_batch((x, y))) for p in progs.values()]
        outs = simulate_ranks([p.module for p in progs.values()], ins, rng_states=states)
        masks.append(torch.cat([o[n_out] for o in outs]))
        grads = {f: outs[0][1 + k] for k, f in enumerate(progs[0].param_fqns)}  # replicated under dp
        for f in params:
            params[f] = params[f] - LR * grads[f]
    if world > 1:
        assert all(torch.equal(s, states[0]) for s in states) == (rng == "global")
    return masks, params


@pytest.fixture(scope="module")
def reference():
    model, batches = _model_and_batches()
    return model, batches, _eager(model, batches)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_global_masks_and_sgd_equal_eager(reference, world):
    model, batches, (eager_masks, eager_params) = reference
    masks, params = _simulate_sgd(model, batches, world, "global")
    for s, (m, e) in enumerate(zip(masks, eager_masks)):
        assert torch.equal(m, e), f"step {s}: {int((m != e).sum())} mask elements differ on {world} ranks"
    for f, p in params.items():
        torch.testing.assert_close(p, eager_params[f], atol=1e-6, rtol=1e-6, msg=f"{f} on {world} ranks")


def test_per_rank_default_keeps_ddp_masks(reference):
    model, batches, (eager_masks, _) = reference
    masks, _ = _simulate_sgd(model, batches, 2, "per-rank")
    assert not torch.equal(masks[0], eager_masks[0])  # each rank draws its own rows' numbers: not eager's
    assert LoweringOptions().rng == "per-rank"


def test_global_program_draws_whole_mask_and_slices_it(reference):
    model, batches, _ = reference
    cg = capture(model, batches[0], F.mse_loss)
    progs = lower(cg, resolve_plan(ManualPlan.parse("dp"), cg, 3), LoweringOptions(rng="global"))
    for r, p in progs.items():
        nodes = list(p.module.graph.nodes)
        draws = [n for n in nodes if n.target in (aten.bernoulli.p, aten.randn_like.default, aten.rand.default)]
        assert [tuple(n.meta["val"].shape) for n in draws] == [(7, 24)] * 3, r  # the whole batch, on every rank
        assert not any(n.target is aten.native_dropout.default for n in nodes)


def test_unknown_rng_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="rng must be one of"):
        LoweringOptions(rng="shared")
