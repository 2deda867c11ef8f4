"""--max-grad-norm with pipeline plans: the global gradient norm over every stage and every dp/tp shard (a tied
weight's copies, dp peers and tp ranks holding a replicated parameter counted once), clipping equal to eager's
torch.nn.utils.clip_grad_norm_: the SGD-updated parameters equal eager's with clipping active (one process here;
through the executor on 4 gloo ranks, pp x dp and pp x tp: test_pipeline_lowered_gloo)."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions
from adaptdist.mesh import Mesh
from adaptdist.models import gpt
from adaptdist.runtime.grad_clip import shard_owners
from adaptdist.runtime.simulate_pipeline import simulate_pipeline
from passutil import global_shard

LR = 0.1


def tiny_gpt(batch_size=8, seq_len=8, seed=0):
    torch.manual_seed(seed)
    return gpt.factory(batch_size, seq_len, gpt.GPTConfig(max_seq_len=seq_len, dim=16, num_layers=2, num_heads=2))


def eager_clipped(model, batch, loss_fn, max_norm):
    ref = copy.deepcopy(model)
    loss_fn(ref(*batch[:-1]), batch[-1]).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    named = dict(ref.named_parameters())  # (a tied weight once, as eager's parameters() has it)
    return norm, {f: p.grad for f, p in named.items()}, {f: (p - LR * p.grad).detach() for f, p in named.items()}


def test_shard_owners_count_each_distinct_shard_once():
    full, half0, half1 = [[0, 4]], [[0, 2]], [[2, 4]]
    owners = shard_owners({0: [("w", half0), ("b", full), ("e", full)], 1: [("w", half1), ("b", full)],
                           2: [("w", half0), ("e", full)]})
    assert owners == {0: {"w", "b", "e"}, 1: {"w"}, 2: set()}


@pytest.mark.parametrize("mesh,world", [(None, 2), ("pp=2,dp=2", 4)])  # pp x tp: test_pipeline_lowered_gloo (slow)
def test_clipped_pipeline_step_equals_eager(mesh, world):
    m, batch, loss_fn = tiny_gpt()
    unclipped, _, _ = eager_clipped(m, batch, loss_fn, float("inf"))
    max_norm = 0.25 * unclipped  # active: every gradient scaled by about 1/4
    norm, grads, params = eager_clipped(m, batch, loss_fn, max_norm)
    progs = compile_model(m, batch, loss_fn, world, None, mesh=mesh, pipeline=PipelineOptions(stages=2, microbatches=2))
    sim = simulate_pipeline(progs, batch, lr=LR, max_grad_norm=max_norm)
    assert sim.grad_norm == pytest.approx(norm, rel=1e-5)
    seen = set()
    for r, p in progs.items():
        st = p.stages[0]
        sub = Mesh(tuple(st.submesh.items())) if st.submesh else None
        j = sub.rank(tuple(st.coords[a] for a in sub.names)) if sub else 0
        order = [a for a in sub.names if a != p.plan.batch_axis] if sub else []
        for f, got in sim.params[r].items():
            pls = p.state_placements.get(f)
            torch.testing.assert_close(sim.grads[r][f], global_shard(grads[f], pls, sub, j, order) if pls else grads[f],
                                       rtol=1e-5, atol=1e-6, msg=f"rank {r} grad {f}")
            want = global_shard(params[f], pls, sub, j, order) if pls else params[f]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {r} param {f}")
            seen.add(f)
    assert seen == set(params)
