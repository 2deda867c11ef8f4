"""Automatic plans lowered and run (all ranks simulated in one process) equal single-process eager:
loss and every rank's shard of every gradient. The lowering follows the planner's node strategies
where the rules agree, so these are plans no manual preset produces (e.g. a model axis that
slices activations by sequence)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model, lowering_order
from adaptdist.compiler.planner import plan_auto
from adaptdist.cost_models.hardware import FixedCluster, LinkFigures
from adaptdist.runtime.simulate import simulate_ranks
from models import tiny_gpt, tiny_llama
from passutil import global_shard
from reference import eager_sgd


def _gpus(n: int) -> FixedCluster:
    cl = FixedCluster.uniform([("h0", n)], kind="cuda")
    return dataclasses.replace(cl, intra_host=LinkFigures("intra_host", 450e9, 5e-6))


@pytest.mark.parametrize("make,batch,world,kind", [
    (tiny_gpt, 4, 2, "cpu"), (tiny_gpt, 4, 4, "cpu"), (tiny_gpt, 64, 2, "cuda"), (tiny_gpt, 64, 4, "cuda"),
    (tiny_llama, 4, 2, "cpu"), (tiny_llama, 4, 4, "cuda"),
])
def test_auto_plan_matches_eager(make, batch, world, kind):
    model, data, loss_fn = make(batch, 8)
    cluster = FixedCluster.uniform([("h", world)]) if kind == "cpu" else _gpus(world)
    result = plan_auto(capture(model, data, loss_fn), cluster)
    progs = compile_model(model, data, loss_fn, world, result.plan)
    mesh = result.plan.mesh_spec
    outs = simulate_ranks([p.module for p in progs.values()],
                          [[p.state[f] for f in p.input_fqns] + list(p.local_batch(data)) for p in progs.values()], mesh)
    (loss, grads), = eager_sgd(model, [data], loss_fn, 0.1, 1)[0]
    order = lowering_order(mesh, result.plan.batch_axis)
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, (r, result.plan.mesh)
        for f in p.param_fqns:
            want = global_shard(grads[f], p.state_placements.get(f), mesh, r, order)
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")], want, atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f} under {result.plan.mesh}")
