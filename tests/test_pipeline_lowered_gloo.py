"""pp-core's lowered pipeline programs (a tiny GPT with a tied embedding / head) run by the executor on 2 and 4 gloo
ranks, every schedule, pp x dp and pp x tp: loss, every gradient and the SGD-updated parameters equal eager (and the first step's loss
pp-core's one-process simulation) to 1e-5; two of the 4-rank cases with --max-grad-norm active (the norm over every
stage, dp peer and tp shard; eager's torch.nn.utils.clip_grad_norm_)."""

from __future__ import annotations

import pytest
import torch

import adaptdist.models.gpt as gpt_module
from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions
from adaptdist.pipeline_schedules import stages_per_rank
from adaptdist.runtime.launch import launch_local
from adaptdist.stage_program_io import save_pipeline_programs
from adaptdist.runtime.simulate_pipeline import simulate_pipeline
from models import tiny_gpt
from pipeline_workers import lowered_pipeline_worker
from reference import eager_sgd

pytestmark = pytest.mark.slow  # starts ranks

STEPS, LR, TOL, B = 2, 0.5, 1e-5, 8
DEEP_LAYERS = 5
"""Blocks of the deeper tiny GPT (a case's optional 5th field; the others have tiny_gpt's default 2)."""

# world -> [(mesh or None, schedule, microbatches, clipped[, GPT blocks])]
CASES = {2: [(None, "gpipe", 2, False), (None, "1f1b", 2, False), (None, "interleaved-1f1b", 2, False),
             (None, "zb", 4, False)],
         4: [(None, "1f1b", 4, False), ("pp=2,dp=2", "zb", 2, True), ("pp=2,dp=2", "interleaved-1f1b", 2, False),
             ("pp=2,tp=2", "1f1b", 2, True),
             # the rest of issue 15 point 3's matrix (pp, pp x dp, pp x tp on 4 ranks, each schedule) in the same
             # launch
             (None, "gpipe", 4, False), ("pp=2,dp=2", "gpipe", 2, False), ("pp=2,dp=2", "1f1b", 2, False),
             ("pp=2,tp=2", "gpipe", 2, False), ("pp=2,tp=2", "interleaved-1f1b", 2, False),
             ("pp=2,tp=2", "zb", 2, False),
             # pp=4 interleaved-1f1b: 2 model chunks per rank = 8 layer groups, the tiny GPT with 5 blocks
             # (tok_emb, pos_emb, blocks.0-4, ln_f)
             (None, "interleaved-1f1b", 4, False, DEEP_LAYERS)]}


def _batches():
    return [tiny_gpt(B, seed=10 + s)[1] for s in range(STEPS)]


@pytest.mark.parametrize("world", [2, 4])
def test_lowered_pipelines_equal_eager(tmp_path, world):
    model, batch, loss_fn = tiny_gpt(B)
    batches = _batches()
    dirs, sims = [], []
    first, _ = eager_sgd(model, batches, loss_fn, LR, 1)
    clip = 0.25 * float(torch.cat([g.reshape(-1) for g in first[0][1].values()]).norm())  # active at every step
    norms = [clip if case[3] else None for case in CASES[world]]
    models = [tiny_gpt(B, num_layers=case[4])[0] if len(case) > 4 else model for case in CASES[world]]
    for i, (mesh, schedule, m, *_) in enumerate(CASES[world]):
        model = models[i]
        inner = ManualPlan.parse("tp", gpt_module) if mesh and "tp" in mesh else None  # the GPT's TP_PLAN
        programs = compile_model(model, batch, loss_fn, world, inner, mesh=mesh,
                                 pipeline=PipelineOptions(
                                     stages=None if mesh else world * stages_per_rank(schedule), microbatches=m,
                                     schedule=schedule, stages_per_rank=stages_per_rank(schedule)))
        sims.append(simulate_pipeline(programs, batches[0]).loss)
        dirs.append(str(save_pipeline_programs(programs, tmp_path / f"case{i}")))
    results = launch_local(lowered_pipeline_worker, (dirs, batches, LR, STEPS, 60.0, norms), world)
    for i, (mesh, schedule, m, *_) in enumerate(CASES[world]):
        model = models[i]
        history, final = eager_sgd(model, batches, loss_fn, LR, STEPS, max_grad_norm=norms[i])
        what = f"{mesh or f'pp={world}'} {schedule} m={m} ({len({f.split('.')[1] for f in final if f.startswith('blocks.')})} blocks){f' clipped to {norms[i]:.4f}' if norms[i] else ''}"
        assert float(sims[i]) == pytest.approx(history[0][0], abs=TOL), what
        held: dict[str, list[int]] = {}
        for r in range(world):
            res = results[r][i]

            def mine(t, f):  # this rank's shard of eager's tensor (the whole tensor unless tp shards it)
                return t[tuple(slice(lo, hi) for lo, hi in res["boxes"][f])]

            for s, (loss, grads) in enumerate(history):
                assert res["losses"][s] == pytest.approx(loss, abs=TOL), (what, r, s)
                for f, g in res["grads"][s].items():
                    torch.testing.assert_close(g, mine(grads[f], f), atol=TOL, rtol=TOL,
                                               msg=f"{what} rank {r} step {s} {f}")
            if norms[i] is not None:  # every rank computed the same global norm, above the limit at every step
                assert all(n > norms[i] for n in res["norms"]), what
                assert res["norms"] == pytest.approx(results[0][i]["norms"], rel=1e-9), what
            for f, p in res["params"].items():
                torch.testing.assert_close(p, mine(final[f], f), atol=TOL, rtol=TOL, msg=f"{what} rank {r} param {f}")
                held.setdefault(f, []).append(r)
        assert set(held) == set(final), what  # every parameter is trained somewhere
        assert len(held["tok_emb.weight"]) >= 2, what  # the tied embedding / head: on the first and last stage
