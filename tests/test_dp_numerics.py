"""Data parallelism on real gloo processes equals single-process eager training.

SGD, 3 steps, float32: loss, every gradient and every updated parameter to 1e-5,
on 2 and 3 ranks, with global batches not divisible by the world size (and, on
3 ranks with 4 rows, a rank with no rows at all).
"""

import pytest
import torch

from adaptdist.lowering_options import LoweringOptions
from adaptdist.compiler.lowering import compile_model
from adaptdist.program import save_programs
from adaptdist.runtime.launch import launch_local
from dist_workers import dp_sgd_worker
from models import convnet, tiny_gpt
from reference import eager_sgd

pytestmark = pytest.mark.slow  # every test here starts ranks (processes)

STEPS, LR, TOL = 3, 0.5, 1e-5


def _batches(factory, batch_size, n):
    out = []
    for s in range(n):
        _, b, _ = factory(batch_size, seed=100 + s)
        out.append(b)
    return out


@pytest.mark.parametrize(
    "factory,batch_size,world",
    [
        (lambda b, seed=0: tiny_gpt(b, 8, seed=seed), 5, 2),  # 3 + 2 rows
        (lambda b, seed=0: tiny_gpt(b, 8, seed=seed), 4, 3),  # 2 + 2 + 0 rows
        (lambda b, seed=0: convnet(b, seed=seed), 7, 3),       # 3 + 3 + 1 rows
    ],
    ids=["gpt-5rows-2ranks", "gpt-4rows-3ranks-empty-rank", "convnet-7rows-3ranks"],
)
def test_dp_sgd_equals_eager(tmp_path, factory, batch_size, world):
    model, example, loss_fn = factory(batch_size)
    batches = _batches(factory, batch_size, STEPS)
    programs = compile_model(model, example, loss_fn, world, options=LoweringOptions(grad_bucket_bytes=8192))
    save_programs(programs, tmp_path / "programs")
    results = launch_local(dp_sgd_worker, (str(tmp_path / "programs"), batches, LR, STEPS), world)
    history, final = eager_sgd(model, batches, loss_fn, LR, STEPS)
    for r in range(world):
        res = results[r]
        for s, (loss, grads) in enumerate(history):
            assert res["losses"][s] == pytest.approx(loss, abs=TOL), (r, s)
            for fqn, g in res["grads"][s].items():
                # eager keeps one .grad for a tied pair; compare it with the summed gradient
                torch.testing.assert_close(g, grads[fqn], atol=TOL, rtol=TOL, msg=f"rank {r} step {s} grad {fqn}")
        for fqn, p in res["params"].items():
            torch.testing.assert_close(p, final[fqn], atol=TOL, rtol=TOL, msg=f"rank {r} param {fqn}")
        assert set(res["params"]) == set(final)  # named_parameters() lists a tied pair once
    chunks = [len(c) for c in torch.arange(batch_size).chunk(world)]
    assert [results[r]["rows"][1] for r in range(world)] == chunks + [0] * (world - len(chunks))
