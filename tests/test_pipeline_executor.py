"""The pipeline executor on gloo ranks with hand-built stage programs: every schedule equals eager (loss, gradients,
SGD-updated parameters), a tied weight stays identical on both stages, a dead peer is an error naming it."""

from __future__ import annotations

import pytest
import torch

from adaptdist.runtime.launch import launch_local
from pipeline_workers import D, Blocks, dead_peer_worker, mse, pipeline_sgd_worker

pytestmark = pytest.mark.slow  # starts ranks

STEPS, LR, TOL, ROWS = 2, 0.3, 1e-5, 8


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)) for _ in range(STEPS)]


def _eager(num_stages, tied, batches):
    model = Blocks(num_stages, tied)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for x, t in batches:
        opt.zero_grad()
        loss = mse(model(x), t)
        loss.backward()
        history.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results, history, final, schedule=""):
    for r, res in results.items():
        for s, (loss, grads) in enumerate(history):
            assert res["losses"][s] == pytest.approx(loss, abs=TOL), (schedule, r, s)
            for f, g in res["grads"][s].items():
                torch.testing.assert_close(g, grads[f], atol=TOL, rtol=TOL, msg=f"{schedule} rank {r} step {s} grad {f}")
        for f, p in res["params"].items():
            torch.testing.assert_close(p, final[f], atol=TOL, rtol=TOL, msg=f"{schedule} rank {r} param {f}")


# (pp, dp, schedule, microbatches, per_rank, tied), by world size (one process group each): every schedule on 2
# ranks (tied weights on three), pp x dp and a 4-stage zero bubble on 4 ranks
CASES = {2: [(2, 1, "gpipe", 2, 1, True), (2, 1, "1f1b", 4, 1, False), (2, 1, "interleaved-1f1b", 2, 2, True),
             (2, 1, "zb", 4, 1, True)],
         4: [(2, 2, "1f1b", 2, 1, True), (4, 1, "zb", 4, 1, False), (2, 2, "interleaved-1f1b", 2, 2, False)]}


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_step_equals_eager(world):
    batches = _batches()
    results = launch_local(pipeline_sgd_worker, (CASES[world], ROWS, batches, LR, STEPS), world)
    for i, (pp, dp, schedule, m, per_rank, tied) in enumerate(CASES[world]):
        case = {r: results[r][i] for r in results}
        history, final = _eager(pp * per_rank, tied, batches)
        _check(case, history, final, schedule)
        if tied:  # both stages' copies of the tied weight: identical after every step
            holders = [r for r, res in case.items() if "layers.0.weight" in res["params"]]
            assert len(holders) >= 2
            for r in holders:
                assert torch.equal(case[r]["params"]["layers.0.weight"], case[holders[0]]["params"]["layers.0.weight"])


def test_a_dead_peer_is_an_error_naming_it():
    out = launch_local(dead_peer_worker, (5.0,), 2)
    assert out[1] == "gone"
    assert "CollectiveTimeoutError" in out[0] and "rank 1" in out[0], out[0]
