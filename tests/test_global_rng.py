"""rng="global" (passes/global_rng.py): random ops draw what one process draws on the whole batch.

Simulated ranks (runtime/simulate.py, each rank with its own generator state, all seeded alike): dropout masks
equal single-process eager bit for bit, and parameters after SGD steps equal eager's to 1e-6, on 1, 2 and 3 ranks
(7 rows: uneven shards on 2 and 3). The default, rng="per-rank", keeps DDP's behaviour (masks depend on the
ranks). Real gloo runs of the backend and of ``adaptdist train`` are in the slow tests at the end.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.errors import UnsupportedOpError, UsageError
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
        # randn_like of a value nothing else reads: it is gone once the whole tensor is drawn instead
        h = h + 0.05 * torch.randn_like(h * 2) + 0.05 * torch.rand(x.shape[0], h.shape[1])
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
    progs = lower(cg, plan, LoweringOptions(rng=rng, debug=True),  # debug: the pass invariants checked after each pass
                  state={f: named[f].detach().clone() for f in cg.input_fqns})
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


def test_global_masks_under_tensor_parallel_on_a_2x2_mesh(reference):
    """dp=2 x tp=2 (4 simulated ranks): the dropout input is sharded on its hidden dim by the column-parallel
    first layer and on its rows by the batch (7 rows: 4 + 3); each rank's mask is its block of eager's, and the
    loss equals eager's."""
    import types

    from adaptdist.mesh import Mesh
    from adaptdist.placement import chunk_interval

    model, batches, (eager_masks, _) = reference
    x, y = batches[0]
    tp = types.SimpleNamespace(TP_PLAN={"a.weight": "S(0)", "a.bias": "S(0)", "b.weight": "S(1)"})
    cg = capture(model, (x, y), F.mse_loss)
    plan = resolve_plan(ManualPlan.parse("dp,tp", tp), cg, 4, "dp=2,tp=2")
    named = dict(model.named_parameters())
    progs = lower(cg, plan, LoweringOptions(rng="global"), state={f: named[f].detach().clone() for f in cg.input_fqns})
    for p in progs.values():
        _expose_masks(p.module)
    mesh = Mesh.parse("dp=2,tp=2")
    torch.manual_seed(SEED)
    states = [torch.get_rng_state() for _ in range(4)]
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch((x, y))) for p in progs.values()]
    outs = simulate_ranks([p.module for p in progs.values()], ins, mesh, rng_states=states)
    eager_model = copy.deepcopy(model)
    torch.manual_seed(SEED)
    loss = F.mse_loss(eager_model(x), y)
    n_out = len(progs[0].output_roles)
    for r in range(4):
        at = dict(zip(mesh.names, mesh.coords(r)))
        (r0, r1), (c0, c1) = chunk_interval(7, 2, at["dp"]), chunk_interval(24, 2, at["tp"])
        assert torch.equal(outs[r][n_out], eager_masks[0][r0:r1, c0:c1]), r
        assert float(outs[r][0]) == pytest.approx(loss.item(), abs=1e-6)


class ProbDraw(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x):
        p = torch.sigmoid(self.a(x))
        return p * torch.bernoulli(p.detach())


def test_random_op_of_sharded_probabilities_is_refused_under_global():
    torch.manual_seed(0)
    model, x, y = ProbDraw(), torch.randn(7, 6), torch.randn(7, 3)
    cg = capture(model, (x, y), F.mse_loss)
    plan = resolve_plan(ManualPlan.parse("dp"), cg, 2)
    lower(cg, plan, LoweringOptions())  # per-rank: each rank draws its rows
    with pytest.raises(UnsupportedOpError, match=r"aten.bernoulli.default.*rng='global' draws each random tensor "
                                                 r"whole.*rng='per-rank'"):
        lower(cg, plan, LoweringOptions(rng="global"))


def test_unknown_rng_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="rng must be one of"):
        LoweringOptions(rng="shared")


# --- real gloo processes ---------------------------------------------------------------------------------------

def _eager_drop_mlp(model, batches, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(SEED)
    masks = []
    for x, y in batches:
        out, h = model(x)
        F.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
        masks.append(h.detach() != 0)
    return masks, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_backend_global_rng_on_gloo_equals_eager():
    """2 gloo ranks through torch.compile(backend=adaptdist.backend(rng='global')): each rank's dropout masks
    are its rows of single-process eager's masks on the whole batch, bit for bit; parameters after 3 SGD steps
    equal eager's to 1e-6; every rank's generator ends where eager's does. Then ranks seeded differently are
    refused."""
    from adaptdist.runtime.launch import launch_local
    from rng_workers import backend_rng_worker, drop_mlp_and_batches

    world, rows = 2, 3
    results = launch_local(backend_rng_worker, (rows, STEPS, LR, SEED), world)
    model, batches = drop_mlp_and_batches(rows * world, STEPS)
    masks, params = _eager_drop_mlp(model, batches, LR)
    end_state = torch.get_rng_state()
    for s in range(STEPS):
        got = torch.cat([results[r]["masks"][s] for r in range(world)])
        assert torch.equal(got, masks[s]), f"step {s}: {int((got != masks[s]).sum())} mask elements differ"
    for r in range(world):
        for f, p in params.items():
            torch.testing.assert_close(results[r]["params"][f], p, atol=1e-6, rtol=1e-6, msg=f"rank {r} {f}")
        assert torch.equal(results[r]["rng"], end_state), r
        # ranks seeded differently: refused on every rank, naming them
        assert "needs the same random generator state on every rank" in results[r]["unseeded"], results[r]["unseeded"]
        assert "ranks [1] differ from rank 0" in results[r]["unseeded"]



TRAIN_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(6, 24); self.drop = nn.Dropout(0.4); self.b = nn.Linear(24, 3)
    def forward(self, x):
        h = self.drop(torch.sigmoid(self.a(x)) + 0.1)
        return self.b(h + 0.05 * torch.randn_like(h))
def factory(batch_size, seq_len):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return M(), (torch.randn(batch_size, 6, generator=g), torch.randn(batch_size, 3, generator=g)), F.mse_loss
'''


@pytest.mark.slow
def test_train_rng_global_on_3_gloo_ranks_equals_eager(tmp_path):
    """``adaptdist train --rng global`` on 3 gloo ranks, 7 rows (3 + 3 + 1): parameters after 3 SGD steps equal
    single-process eager's (seeded with --seed) to 1e-6."""
    import importlib.util

    from safetensors.torch import load_file

    from adaptdist.cli import main

    (tmp_path / "dropmodel.py").write_text(TRAIN_MODEL)
    out = tmp_path / "run"
    rc = main(["train", f"{tmp_path / 'dropmodel.py'}:factory", "--nproc", "3", "--batch-size", "7", "--seq-len", "1",
               "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--seed", str(SEED), "--rng", "global",
               "--plan", "dp", "--out", str(out), "--threads-per-rank", "1", "--sample-bytes", "0",
               "--collective-timeout-s", "60"])
    assert rc == 0
    spec = importlib.util.spec_from_file_location("dropmodel", tmp_path / "dropmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, (x, y), loss_fn = mod.factory(7, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(SEED)
    for _ in range(STEPS):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    trained = load_file(str(out / "model.safetensors"))
    for f, p in model.named_parameters():
        torch.testing.assert_close(trained[f], p.detach(), atol=1e-6, rtol=1e-6, msg=f)


@pytest.mark.bench
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_hf_gpt2_with_dropout_through_the_backend_equals_eager(plan):
    """HF GPT-2 in training mode (dropout 0.1 on embeddings, attention probabilities, attention and MLP outputs)
    on 2 gloo ranks with rng='global': losses and parameters after 3 SGD steps equal single-process eager's on
    the whole batch. Outside CI (-m bench): ~1 min each."""
    from adaptdist.runtime.launch import launch_local
    from rng_workers import hf_gpt2_dropout, hf_gpt2_loss, hf_gpt2_rng_worker

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (4, 8), generator=g), torch.randint(0, 97, (4, 8), generator=g)
    results = launch_local(hf_gpt2_rng_worker, (x, y, STEPS, LR, SEED, plan), 2)
    model = hf_gpt2_dropout()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(SEED)
    losses = []
    for _ in range(STEPS):
        loss = hf_gpt2_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for r in range(2):
        assert results[r]["losses"] == pytest.approx(losses, abs=1e-5), r
        for f, p in model.state_dict().items():
            torch.testing.assert_close(results[r]["params"][f], p, atol=1e-5, rtol=1e-5, msg=f"rank {r} {f}")


def test_compile_records_rng_for_adaptdist_run(tmp_path):
    """``adaptdist compile --rng global`` records it in the manifest; ``adaptdist run`` seeds every rank alike then
    (runtime.run_artifacts / cli.main read it into TrainConfig.rng)."""
    import json

    from adaptdist.cli import main

    (tmp_path / "m.py").write_text(TRAIN_MODEL)
    out = tmp_path / "art"
    assert main(["compile", f"{tmp_path / 'm.py'}:factory", "--nproc", "2", "--batch-size", "4", "--seq-len", "1",
                 "--plan", "dp", "--rng", "global", "-o", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["rng"] == "global"


@pytest.mark.bench
def test_train_rng_global_resumed_on_another_world_size_equals_eager(tmp_path):
    """``--rng global``: 2 steps on 2 ranks, then ``--resume --nproc 3`` to 4 steps: the RNG continues from rank 0's
    saved state (the same on every rank), so the parameters equal 4 uninterrupted single-process eager steps.
    Outside CI (-m bench): ~1.5 min."""
    import importlib.util

    from safetensors.torch import load_file

    from adaptdist.cli import main

    (tmp_path / "dropmodel.py").write_text(TRAIN_MODEL)
    out = tmp_path / "run"
    common = ["--threads-per-rank", "1", "--collective-timeout-s", "60"]
    assert main(["train", f"{tmp_path / 'dropmodel.py'}:factory", "--nproc", "2", "--batch-size", "7", "--seq-len",
                 "1", "--steps", "2", "--checkpoint-every", "2", "--optimizer", "sgd", "--lr", str(LR), "--seed",
                 str(SEED), "--rng", "global", "--plan", "dp", "--out", str(out), "--sample-bytes", "0", *common]) == 0
    assert main(["train", "--resume", str(out), "--nproc", "3", "--steps", "4", *common]) == 0
    spec = importlib.util.spec_from_file_location("dropmodel", tmp_path / "dropmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, (x, y), loss_fn = mod.factory(7, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(SEED)
    for _ in range(4):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    trained = load_file(str(out / "model.safetensors"))
    for f, p in model.named_parameters():
        torch.testing.assert_close(trained[f], p.detach(), atol=1e-6, rtol=1e-6, msg=f)
