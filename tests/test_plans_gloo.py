"""Manual plans (tensor parallel, FSDP-like) on real gloo processes: 3 SGD steps equal eager.

Each rank's loss, its shard of every gradient and of every updated parameter match
single-process eager training to 1e-5.
"""

import pytest
import torch

from adaptdist.annotations import resolve_param_placements
from adaptdist.compiler.capture import capture
from adaptdist.compiler.data_parallel import lower
from adaptdist.program import save_programs
from adaptdist.runtime.launch import launch_local
from dist_workers import dp_sgd_worker
from models import mlp
from passutil import local_shard
from reference import eager_sgd

STEPS, LR, TOL = 3, 0.5, 1e-5
from adaptdist.models.gpt import TP_PLAN
from models import tiny_gpt


def _gpt(seed=0):
    return tiny_gpt(4, 8, seed=seed, num_heads=4)


def _mlp(seed=0):
    return mlp(7, seed=seed)


PLANS = {  # name: (model factory, annotations, split the batch?)
    "mlp-tp": (_mlp, {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"}, False),
    "mlp-fsdp": (_mlp, {"fc*.weight": "S(0)", "fc*.bias": "S(0)"}, True),
    "gpt-megatron-tp": (_gpt, TP_PLAN, False),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("world", [2, 4])
def test_plan_sgd_equals_eager(tmp_path, plan, world):
    factory, annotations, shard_batch = PLANS[plan]
    model, example, loss_fn = factory()
    batches = [factory(seed=10 + s)[1] for s in range(STEPS)]
    cg = capture(model, example, loss_fn)
    named = dict(model.named_parameters())
    pp = resolve_param_placements({f: tuple(named[f].shape) for f in cg.input_fqns}, annotations)
    programs = lower(cg, world, mesh_axis="dp" if shard_batch else "tp", shard_batch=shard_batch,
                     param_placements=pp, state={f: named[f].detach() for f in cg.input_fqns})
    save_programs(programs, tmp_path / "programs")
    results = launch_local(dp_sgd_worker, (str(tmp_path / "programs"), batches, LR, STEPS), world)
    history, final = eager_sgd(model, batches, loss_fn, LR, STEPS)
    for r in range(world):
        res = results[r]
        for s, (loss, grads) in enumerate(history):
            assert res["losses"][s] == pytest.approx(loss, abs=TOL), (r, s)
            for f, g in res["grads"][s].items():
                torch.testing.assert_close(g, local_shard(grads[f], pp.get(f), world, r), atol=TOL, rtol=TOL,
                                           msg=f"rank {r} step {s} grad {f}")
        for f, p in res["params"].items():
            torch.testing.assert_close(p, local_shard(final[f], pp.get(f), world, r), atol=TOL, rtol=TOL,
                                       msg=f"rank {r} param {f}")
