"""Manual plans (tensor parallel, FSDP-like, DP x TP on a 2-D mesh) on real gloo processes.

3 SGD steps of each rank's program equal single-process eager training to 1e-5: the
loss, this rank's shard of every gradient and of every updated parameter. All cases of
one world size run in one process group (one launch), to keep CI fast.
"""

import importlib.util
import types

import pytest
import torch

import adaptdist.models.gpt as gpt_module
import adaptdist.models.llama as llama_module
from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import compile_model, lowering_order
from adaptdist.mesh import Mesh
from adaptdist.program import save_programs
from adaptdist.runtime.launch import launch_local
from dist_workers import multi_case_sgd_worker
from models import HF_LLAMA_TP_PLAN, hf_llama, hf_vit, mlp, tiny_gpt, tiny_llama, tiny_vit, two_shards
from passutil import global_shard
from reference import eager_sgd

pytestmark = pytest.mark.slow  # every test here starts ranks (processes)

STEPS, LR, TOL = 3, 0.5, 1e-5
S1_TO_S0 = ManualPlan("s1-s0", ("tp",), None, (("a", ("S(1)",)), ("b", ("S(0)",))))  # all_to_all
MLP_TP = ManualPlan("mlp-tp", ("tp",), None, (("fc1.weight", ("S(0)",)), ("fc1.bias", ("S(0)",)),
                                              ("fc2.weight", ("S(1)",))))
FACTORIES = {"two_shards": lambda seed=0: two_shards(3, 9, 7, seed=seed), "mlp": lambda seed=0: mlp(7, seed=seed), "gpt": lambda seed=0: tiny_gpt(4, 8, seed=seed, num_heads=4),
             "llama": lambda seed=0: tiny_llama(4, 8, seed=seed), "vit": lambda seed=0: tiny_vit(5, seed=seed),
             "hf_vit": lambda seed=0: hf_vit(5, seed=seed), "hf_llama": lambda seed=0: hf_llama(4, 8, seed=seed)}
MODULES = {"two_shards": None, "mlp": None, "gpt": gpt_module, "llama": llama_module, "vit": None, "hf_vit": None,
           "hf_llama": types.SimpleNamespace(TP_PLAN=HF_LLAMA_TP_PLAN)}

# (model, plan, mesh or None for a 1-D mesh of the world size, max grad norm)
CASES = {
    2: [("two_shards", "tp", None, None), ("mlp", "tp", None, None), ("mlp", "fsdp", None, None), ("gpt", "tp", None, None),
        ("gpt", "fsdp", None, None), ("llama", "tp", None, None), ("llama", "fsdp", None, None),
        ("gpt", "dp", None, 0.5), ("vit", "fsdp", None, None), ("hf_vit", "fsdp", None, None),
        ("hf_llama", "tp", None, None)],
    4: [("two_shards", "tp", None, None), ("mlp", "tp", None, None), ("mlp", "fsdp", None, None), ("gpt", "tp", None, None),
        ("gpt", "fsdp", None, 0.5), ("llama", "fsdp", None, None), ("gpt", "dp,tp", "dp=2,tp=2", None),
        ("llama", "dp,tp", "dp=2,tp=2", None), ("gpt", "dp,tp", "dp=2,tp=2", 0.5)],
}


def _plan(model_name, plan):
    if model_name == "two_shards":
        return S1_TO_S0
    return MLP_TP if (model_name, plan) == ("mlp", "tp") else ManualPlan.parse(plan, MODULES[model_name])


@pytest.mark.parametrize("world", [2, 4])
def test_plans_sgd_equal_eager(tmp_path, world):
    prepared, launch_cases = [], []
    cases = [c for c in CASES[world] if not c[0].startswith("hf_") or importlib.util.find_spec("transformers")]
    for i, (name, plan_text, mesh_text, clip) in enumerate(cases):
        model, example, loss_fn = FACTORIES[name]()
        batches = [FACTORIES[name](seed=10 + s)[1] for s in range(STEPS)]
        plan = _plan(name, plan_text)
        programs = compile_model(model, example, loss_fn, world, plan, mesh=mesh_text)
        save_programs(programs, tmp_path / f"case{i}")
        launch_cases.append((str(tmp_path / f"case{i}"), batches, clip))
        prepared.append((f"{name} {plan_text} {mesh_text or ''} clip={clip}", model, loss_fn, batches, programs, clip))
    results = launch_local(multi_case_sgd_worker, (launch_cases, LR, STEPS), world)
    name_of = [name for name, *_ in cases]
    for i, (label, model, loss_fn, batches, programs, clip) in enumerate(prepared):
        history, final = eager_sgd(model, batches, loss_fn, LR, STEPS, max_grad_norm=clip)
        p0 = programs[0]
        mesh = Mesh(tuple(p0.mesh.items()))
        order = lowering_order(mesh, p0.plan.batch_axis)
        for r in range(world):
            res = results[r][i]
            pls = programs[r].state_placements
            for s, (loss, grads) in enumerate(history):
                assert res["losses"][s] == pytest.approx(loss, abs=TOL), (label, r, s)
                for f, g in res["grads"][s].items():
                    torch.testing.assert_close(g, global_shard(grads[f], pls.get(f), mesh, r, order), atol=TOL,
                                               rtol=TOL, msg=f"{label}: rank {r} step {s} grad {f}")
            for f, p in res["params"].items():
                torch.testing.assert_close(p, global_shard(final[f], pls.get(f), mesh, r, order), atol=TOL,
                                           rtol=TOL, msg=f"{label}: rank {r} param {f}")
            if clip is not None:
                assert res["norms"][0] > clip, f"{label}: the test must actually clip"
        if name_of[i] in ("vit", "hf_vit"):  # dim 0 of the class token has 1 row: FSDP shards its dim 2
            cls = "cls_token" if name_of[i] == "vit" else "vit.vit.embeddings.cls_token"
            assert programs[0].state_placements[cls] == ["S(2)"], programs[0].state_placements
