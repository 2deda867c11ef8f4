"""Training-mode BatchNorm over a split batch (issue 14, point 4): ``local`` (DDP's per-rank statistics, rank
0's running buffers) and ``sync`` (SyncBatchNorm's global statistics), against eager, with ranks simulated."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import CaptureError, UsageError
from adaptdist.lowering_options import LoweringOptions
from models import convnet
from passutil import simulated_sgd

LR, STEPS, WORLD = 0.1, 3, 2


def _lowered_sgd(model, batch, loss_fn, plan: str, mode: str, world: int = WORLD):
    """SGD steps through the simulated rank programs; per step (loss, {fqn: full grad}), final params, buffers."""
    _, hist, params, buffers = simulated_sgd(model, batch, loss_fn, world, plan, LR, STEPS, batch_norm=mode)
    return hist, params, {f: b for f, b in buffers.items() if "running" in f}


def _eager_local(model, batch, loss_fn, world: int = WORLD):
    """DDP: each rank's rows through its own BatchNorm; loss = mean of rank losses, gradients averaged; the
    running buffers of rank 0 (DDP broadcasts them at every forward)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = list(zip(*(t.chunk(world) for t in batch)))
    hist = []
    for _ in range(STEPS):
        opt.zero_grad()
        replicas = [copy.deepcopy(model) for _ in rows]
        losses = [loss_fn(m(*r[:-1]), r[-1]) for m, r in zip(replicas, rows)]
        total = sum(losses) / world
        total.backward()
        grads = {n: sum(dict(m.named_parameters())[n].grad for m in replicas) for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        hist.append((total.item(), grads))
        opt.step()
        for n, b in replicas[0].named_buffers():
            dict(model.named_buffers())[n].copy_(b)
    return hist, dict(model.named_parameters()), dict(model.named_buffers())


def _eager_global(model, batch, loss_fn, steps: int = STEPS, lr: float = LR):
    """One process on the whole batch: plain BatchNorm over the global batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    hist = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        hist.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return hist, dict(model.named_parameters()), dict(model.named_buffers())


def _assert_equal(got, want, atol=2e-5):
    (gh, gp, gb), (wh, wp, wb) = got, want
    for (gl, gg), (wl, wg) in zip(gh, wh):
        assert abs(gl - wl) < atol, (gl, wl)
        for f in wg:
            assert torch.allclose(gg[f], wg[f], atol=atol), (f, (gg[f] - wg[f]).abs().max())
    for f in wp:
        assert torch.allclose(gp[f], wp[f].detach(), atol=atol), (f, (gp[f] - wp[f]).abs().max())
    for f, per_rank in gb.items():
        for r, v in enumerate(per_rank):  # every rank holds the same running statistics
            assert torch.allclose(v, wb[f], atol=atol), (f, r, (v - wb[f]).abs().max())


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_local_equals_ddp_per_rank_statistics(plan):
    model, batch, loss_fn = convnet(4, batch_norm=True)
    got = _lowered_sgd(model, batch, loss_fn, plan, "local")
    _assert_equal(got, _eager_local(model, batch, loss_fn))
    # and it is not the global-batch model (the statistics differ)
    assert abs(got[0][0][0] - _eager_global(model, batch, loss_fn)[0][0][0]) > 1e-4


@pytest.mark.parametrize("plan,batch_size", [("dp", 4), ("dp", 5), ("fsdp", 4)])
def test_sync_equals_batch_norm_on_the_global_batch(plan, batch_size):
    model, batch, loss_fn = convnet(batch_size, batch_norm=True)
    _assert_equal(_lowered_sgd(model, batch, loss_fn, plan, "sync"), _eager_global(model, batch, loss_fn))


def test_batch_norm_1d_and_local_on_three_ranks():
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g))
    _assert_equal(_lowered_sgd(model, batch, F.cross_entropy, "dp", "sync"), _eager_global(model, batch, F.cross_entropy))
    conv, cbatch, loss_fn = convnet(6, batch_norm=True)
    _assert_equal(_lowered_sgd(conv, cbatch, loss_fn, "dp", "local", world=3), _eager_local(conv, cbatch, loss_fn, world=3))


def test_sync_on_three_ranks_and_the_automatic_plan():
    model, batch, loss_fn = convnet(6, batch_norm=True)
    want = _eager_global(model, batch, loss_fn)
    _assert_equal(_lowered_sgd(model, batch, loss_fn, "dp", "sync", world=3), want)
    # the automatic plan used to crash in localization ("Attempting to broadcast a dimension of length 4")
    _assert_equal(_lowered_sgd(model, batch, loss_fn, "auto", "sync"), want)


def test_sync_all_reduces_per_channel_sums_in_forward_and_backward():
    model, batch, loss_fn = convnet(4, batch_norm=True)
    sync = compile_model(model, batch, loss_fn, 2, None, LoweringOptions(batch_norm="sync"))
    local = compile_model(model, batch, loss_fn, 2, None, LoweringOptions(batch_norm="local"))
    assert "batch_norm" not in sync[0].graph_module.code  # rewritten into sums
    channels = [c for c in sync[0].collectives() if c.endswith(", 4)")]  # 4 channels: mean, var; grad sums
    assert len(channels) >= 4
    # local: only rank 0's running mean and variance are all-reduced on top of the gradients and the loss
    assert len([c for c in local[0].collectives() if c.endswith(", 4)")]) == 2


def test_batch_norm_option_is_validated():
    with pytest.raises(UsageError, match="batch_norm must be one of"):
        LoweringOptions(batch_norm="global")
    import adaptdist

    with pytest.raises(UsageError, match="batch_norm='global'"):
        adaptdist.backend(batch_norm="global")


def test_cli_flag_reaches_the_lowering_options():
    from adaptdist.cli.common import lowering_options
    from adaptdist.cli.main import build_parser

    args = build_parser().parse_args(["train", "--batch-norm", "sync"])
    assert lowering_options(args).batch_norm == "sync"
    assert lowering_options(build_parser().parse_args(["train"])).batch_norm == "local"


def test_backend_captures_running_statistics_as_buffer_outputs():
    """The backend's all-ranks capture returns rank 0's new running statistics and num_batches_tracked as
    ``buffer:`` outputs (the runtime writes them into the module's buffers); ``sync`` sums every rank's rows."""
    from adaptdist import graph_meta as gmeta
    from adaptdist.compiler.dynamo_capture import capture_all_ranks, check_batch_norm, classify_inputs

    got = {}

    def grab(gm, example_inputs):  # the sources Dynamo records are read while it compiles
        got["gm"], got["inputs"] = gm, classify_inputs(gm, example_inputs)
        return gm

    model, batch, _ = convnet(4, batch_norm=True)
    torch.compile(model, backend=grab, dynamic=False)(batch[0][:2])
    inputs = got["inputs"]
    buffers = ["buffer:norm.num_batches_tracked", "buffer:norm.running_mean", "buffer:norm.running_var"]
    for mode in ("local", "sync"):
        check_batch_norm(got["gm"], mode)
        cg, _ = capture_all_ranks(got["gm"], inputs, WORLD, mode)
        roles = gmeta.get_output_roles(cg.gm.graph.output_node())
        assert sorted(r for r in roles if r.startswith("buffer:")) == buffers
        assert "batch_norm" not in cg.gm.code  # plain sums over the rows of each rank (local) or of all (sync)
        from adaptdist.compiler.lowering import lower, resolve_plan

        progs = lower(cg, resolve_plan(ManualPlan.parse("dp"), cg, WORLD, None), LoweringOptions(batch_norm=mode))
        sizes = [int(c.rsplit(", ", 1)[1][:-1]) for c in progs[0].collectives()]
        assert max(sizes) < 512, progs[0].collectives()  # no activation (2x4x8x8 per rank) is gathered or reduced
        # sync: mean and variance all-reduced per channel in forward, their gradients in backward; local: only rank
        # 0's running mean and variance are gathered ([1, 4] from each rank)
        assert sizes.count(4) == (4 if mode == "sync" else 2), progs[0].collectives()
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(CaptureError, match="BatchNorm.*autocast"):
        capture_all_ranks(got["gm"], inputs, WORLD, "local")  # refused, not traced per rank


BN_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1); self.norm = nn.BatchNorm2d(4); self.head = nn.Linear(4, 3)
    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2).mean(dim=(2, 3)))
def factory(batch_size, seq_len):
    torch.manual_seed(0)
    model = ConvNet()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch_size, 3, 8, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)), F.cross_entropy
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_cli_sync_under_auto_equals_eager_on_gloo(tmp_path):
    """``adaptdist train --plan auto --batch-norm sync`` on 2 gloo ranks (auto used to crash in localization): the
    trained parameters and running buffers equal single-process eager SGD on the repeated example batch."""
    import importlib.util

    from safetensors.torch import load_file

    from adaptdist.cli import main

    (tmp_path / "bnmodel.py").write_text(BN_MODEL)
    out = tmp_path / "run"
    steps, lr = 3, 0.1
    rc = main(["train", f"{tmp_path / 'bnmodel.py'}:factory", "--nproc", "2", "--plan", "auto", "--batch-norm", "sync",
               "--batch-size", "4", "--seq-len", "1", "--steps", str(steps), "--optimizer", "sgd", "--lr", str(lr),
               "--out", str(out), "--threads-per-rank", "1", "--sample-bytes", "0"])
    assert rc == 0
    spec = importlib.util.spec_from_file_location("bnmodel", tmp_path / "bnmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, batch, loss_fn = mod.factory(4, 1)
    _, params, buffers = _eager_global(model, batch, loss_fn, steps, lr)
    got = load_file(str(out / "model.safetensors"))
    for name, want in {**params, **buffers}.items():
        if name in got:
            torch.testing.assert_close(got[name], want.detach(), atol=2e-5, rtol=0, msg=name)
    assert "norm.running_mean" in got and "norm.weight" in got


BACKEND_BN_CASES = [dict(model="convnet", plan="dp", batch_norm="local"),
                    dict(model="convnet", plan="fsdp", batch_norm="local"),
                    dict(model="convnet", plan="dp", batch_norm="sync"),
                    dict(model="convnet", plan="fsdp", batch_norm="sync"),
                    dict(model="mlp_bn1d", plan="dp", batch_norm="sync")]  # BatchNorm1d over [N, C]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_backend_batch_norm_local_and_sync_equal_eager_on_gloo():
    """``torch.compile(model, backend=adaptdist.backend(batch_norm=...))`` on 2 gloo ranks, each rank its rows, 3
    SGD steps: ``local`` equals DDP (each rank's statistics, the mean of the rank losses, every rank's running
    buffers rank 0's), ``sync`` equals plain BatchNorm on the global batch; losses, gradients, parameters and the
    module's running_mean / running_var / num_batches_tracked as each rank's user sees them."""
    from adaptdist.runtime.launch import launch_local
    from bn_workers import backend_cases_worker, factory

    results = launch_local(backend_cases_worker, (BACKEND_BN_CASES, STEPS, LR), WORLD)
    for k, case in enumerate(BACKEND_BN_CASES):
        model, batch, loss_fn = factory(case["model"])
        want_hist, want_params, want_buffers = (_eager_local(model, batch, loss_fn) if case["batch_norm"] == "local"
                                                else _eager_global(model, batch, loss_fn))
        for r in range(WORLD):
            got = results[r][k]
            assert "error" not in got, (case, got.get("error"))
            for s, (want_loss, want_grads) in enumerate(want_hist):
                # each rank's loss is its rows' mean: their mean is DDP's loss, and (equal shards) the global one
                mean_loss = sum(results[q][k]["losses"][s] for q in range(WORLD)) / WORLD
                assert abs(mean_loss - want_loss) < 2e-5, (case, s, mean_loss, want_loss)
                for n, g in want_grads.items():
                    torch.testing.assert_close(got["grads"][s][n], g, atol=2e-5, rtol=0, msg=f"{case} rank {r} {n}")
            for n, p in want_params.items():
                torch.testing.assert_close(got["params"][n], p.detach(), atol=2e-5, rtol=0, msg=f"{case} rank {r} {n}")
            prefix = "norm." if case["model"] == "convnet" else "1."
            assert set(got["buffers"]) == set(want_buffers) == {prefix + b for b in (
                "running_mean", "running_var", "num_batches_tracked")}
            for n, b in want_buffers.items():
                torch.testing.assert_close(got["buffers"][n], b, atol=2e-5, rtol=0, msg=f"{case} rank {r} {n}")
    # the two semantics differ (per-rank vs global statistics), in the gradients and the running statistics
    local, sync = results[0][0], results[0][2]
    assert (local["grads"][0]["conv.weight"] - sync["grads"][0]["conv.weight"]).abs().max() > 1e-4
    assert (local["buffers"]["norm.running_var"] - sync["buffers"]["norm.running_var"]).abs().max() > 1e-4
