"""The torch.compile backend on nn.MultiheadAttention(batch_first=True) models (nn.TransformerEncoder, a plain
MHA): the batch split survives MHA's merge of [T, B, D] into [T*B, D] rows, with no rewrite needed, and fsdp
gathers the parameters in buckets as ``adaptdist train`` does.

Why no rewrite (compiler/batch_inner_merges.py, which ``adaptdist train``'s capture needs): the backend captures
every rank's forward at once under ``torch.vmap`` over a leading rank dim, and splits only that dim (the
captured batch size is the world size; a rank's own rows are never split). vmap keeps the rank dim outermost in
every merge: one rank's ``[T, B, D] -> [T*B, D]`` is ``[W, T, B, D] -> [W, T*B, D]`` (and ``[W*T*B, D]`` for the
matmuls), the batch inside but the rank outside, so dp's ``Shard(0)`` of the rank dim is kept by every view.

Measured before compiler/unit_scalings.py (TransformerEncoderLayer(64, 4, batch_first) x2 + head, 4 rows of 16
tokens per rank, 2 ranks, rank 0's program): dp 0 all_gathers, 2 all_reduces (as train: 0 all_gathers);
fsdp 10 all_gathers, 8 of them one bias each (vmap's addmm wrote ``mul(bias, 1)``, which hid the bias from the
bucketing pass), against train's 2 bucketed ones; after: 2, as train.
"""

from __future__ import annotations

import re

import pytest
import torch

import adaptdist
import adaptdist.compiler.capture as capture_mod
from adaptdist.annotations import ManualPlan
from adaptdist.compiler.batch_inner_merges import reorder_batch_inner_merges
from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.lowering_options import LoweringOptions
from models import self_attention, transformer_encoder

T, B, D = 5, 4, 16  # B: rows per rank
MODELS = {"encoder": transformer_encoder, "mha": self_attention}


def _gathers(prog) -> list[str]:
    """The local shapes of the all_gathers of a rank program."""
    return re.findall(r"all_gather_into_tensor[a-z_]*\.default\(.*# (\w+\[[^\]]*\])", prog.code)


def _activation_rows(prog) -> set[int]:
    """The rows of every matmul on activations (a multiple of T, not a weight gradient's [D, *] or [*, D])."""
    rows = set()
    for m in re.finditer(r"aten\.(?:addmm|mm)\.default\(.*# f32\[(\d+), (\d+)\]", prog.code):
        if int(m.group(1)) % T == 0 and int(m.group(1)) not in (D, 2 * D, 3 * D):
            rows.add(int(m.group(1)))
    return rows


def _backend_capture(name: str, world: int):
    """The backend's all-ranks capture of model ``name`` (``B`` rows per rank)."""
    model, (x, _), _ = MODELS[name](B, T, d_model=D)
    seen = {}

    def capture_only(gm, example_inputs):
        seen["captured"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), world)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture_only, dynamic=False)(x)
    return seen["captured"]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_backend_keeps_the_batch_split_and_buckets_as_train(name, plan):
    """2 ranks: rank 0 gathers no activation (dp: no all_gather; fsdp: flat parameter buckets only, as many as
    ``adaptdist train``'s program of the same model has) and every matmul on activations runs on its own T*B rows;
    batch_inner_merges finds nothing to reorder in the backend's graph (the module docstring says why)."""
    captured = _backend_capture(name, 2)
    prog = lower(captured, resolve_plan(ManualPlan.parse(plan), captured, 2), LoweringOptions())[0]
    model, batch, loss_fn = MODELS[name](2 * B, T, d_model=D)
    train_cap = capture_mod.capture(model, batch, loss_fn)
    train_prog = lower(train_cap, resolve_plan(ManualPlan.parse(plan), train_cap, 2), LoweringOptions())[0]
    gathers, train_gathers = _gathers(prog), _gathers(train_prog)
    if plan == "dp":
        assert gathers == [] and train_gathers == [], (gathers, train_gathers)
    else:
        assert gathers and all(re.fullmatch(r"f32\[\d+\]", s) for s in gathers), gathers  # parameter buckets
        assert len(gathers) == len(train_gathers), (gathers, train_gathers)
    assert _activation_rows(prog) == {T * B}, _activation_rows(prog)
    assert _activation_rows(train_prog) == {T * B}, _activation_rows(train_prog)
    assert reorder_batch_inner_merges(captured.gm) == 0


def test_backend_trains_the_encoder_as_eager_on_one_rank():
    """One process (world of one): 3 SGD steps through torch.compile equal eager's loss and gradients (1e-5)."""
    results = []
    for compiled in (True, False):
        model, (x, y), loss_fn = transformer_encoder(B, T, d_model=D)
        fn = torch.compile(model, backend=adaptdist.backend(plan="dp"), dynamic=False) if compiled else model
        torch._dynamo.reset()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = []
        for _ in range(3):
            loss = loss_fn(fn(x), y)
            loss.backward()
            steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        results.append((steps, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (got, got_params), (want, want_params) = results
    for (l1, g1), (l2, g2) in zip(got, want, strict=True):
        assert l1 == pytest.approx(l2, abs=1e-5)
        for n in g2:
            torch.testing.assert_close(g1[n], g2[n], atol=1e-5, rtol=0, msg=n)
    for n in want_params:
        torch.testing.assert_close(got_params[n], want_params[n], atol=1e-5, rtol=0, msg=n)


CASES = [dict(model=m, plan=p, batch=2 * B) for m in ("encoder", "mha") for p in ("dp", "fsdp")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_backend_on_two_ranks_equals_eager_without_activation_gathers():
    """2 gloo ranks, the README's loop (torch.compile, SGD, each rank its own rows), 3 steps per case: every rank's
    losses, gradients and SGD-updated parameters equal eager's (1e-5); in each compiled graph dp issues no all_gather,
    fsdp 2 (the forward's and the backward's parameter buckets)."""
    from adaptdist.runtime.launch import launch_local
    from backend_workers import suite_worker
    from test_dynamo_backend import LR, STEPS, _assert_cases_equal_eager, _part

    suite = launch_local(suite_worker, ([("sgd", "backend_sgd_worker", (CASES, STEPS, LR)),
                                         ("teardown", "teardown_worker", ())],), 2)
    results = _part(suite, "sgd")
    _assert_cases_equal_eager(CASES, results, 2)
    for k, case in enumerate(CASES):
        for calls in results[0][k]["collectives"]:  # each compiled graph (the eval pass under no_grad: its own)
            gathers = [c for c in calls if "all_gather" in c]
            assert len(gathers) == (0 if case["plan"] == "dp" else 2), (case, calls)
