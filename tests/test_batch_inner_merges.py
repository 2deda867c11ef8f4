"""compiler/batch_inner_merges.py: nn.MultiheadAttention(batch_first=True)'s merge of [T, B, D] into [T*B, D] rows
keeps the batch split (once gathered: every rank computed the whole batch behind it), numbers as eager's."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptdist.compiler.capture as capture_mod
from adaptdist.compiler.planner import plan_auto
from adaptdist.cost_models.hardware import FixedCluster
from models import transformer_encoder
from test_capture_edge_cases import _plan, train_simulated

T, B, D = 5, 4, 16


def encoder(batch_size: int = B, seq_len: int = T):
    return transformer_encoder(batch_size, seq_len, d_model=D)


def _collectives(prog) -> dict[str, list[str]]:
    """Rank program's collectives: op name -> the local shapes of their outputs."""
    out: dict[str, list[str]] = {}
    for line in prog.code.splitlines():
        m = re.search(r"torch\.ops\.[a-z_0-9]+\.((?:shm_)?(?:flatten_)?(all_gather_into_tensor|all_reduce|all_to_all_single|"
                      r"reduce_scatter_tensor)[a-z_]*)\.default\(.*# (\w+\[[^\]]*\])", line)
        if m:
            out.setdefault(m.group(2), []).append(m.group(3))
    return out


def _row_counts(prog) -> set[int]:
    """The rows of every matmul on activations (rows a multiple of T; not the weight gradients') on the rank:
    [T*B/2, ...] when the batch stays split."""
    rows = set()
    for line in prog.code.splitlines():
        m = re.search(r"aten\.(?:addmm|mm)\.default\(.*# f32\[(\d+), (\d+)\]", line)
        if m and int(m.group(1)) % T == 0:
            rows.add(int(m.group(1)))
    return rows


@pytest.mark.parametrize("plan", ["dp", "fsdp", "auto"])
def test_encoder_keeps_the_batch_split_and_trains_as_eager(plan, monkeypatch):
    """2 simulated ranks, 3 SGD steps: loss, every gradient shard and the updated parameters equal eager's; rank 0
    gathers no activation (dp, auto: no all_gather; fsdp: only flat parameter buckets), no all_to_all, and under
    dp/fsdp every matmul on activations runs on the rank's T*B/2 rows. Before (d_model 64, B 8, T 128): dp 4
    all_gathers of [B, T, D] activations, fsdp 13 all_gathers and 6 all_to_alls, auto 16 all_to_alls."""
    counts = []
    real = capture_mod.reorder_batch_inner_merges
    monkeypatch.setattr(capture_mod, "reorder_batch_inner_merges", lambda gm: counts.append(real(gm)) or counts[-1])
    fo = encoder()
    p = plan_auto(capture_mod.capture(*fo), FixedCluster.uniform([("h", 2)])).plan if plan == "auto" \
        else _plan(plan, "encoder", fo, 2)
    progs = train_simulated(*encoder(), 2, p)
    # per layer: in_proj and out_proj merges, their gradients' merges (the forward ones again in train_simulated)
    assert counts and all(c == 8 for c in counts), counts
    coll = _collectives(progs[0])
    gathers = coll.get("all_gather_into_tensor", [])
    assert "all_to_all_single" not in coll, coll
    if plan == "fsdp":
        assert gathers and all(re.fullmatch(r"f32\[\d+\]", s) for s in gathers), coll  # parameter buckets
    else:
        assert not gathers, coll
    if plan != "auto":  # (the planner may run this small model whole on each rank: it did, [T*B] rows, no gather)
        assert _row_counts(progs[0]) == {T * B // 2}, _row_counts(progs[0])


class _RowsUsedOtherwise(nn.Module):
    """[T, B, D] merged into rows, then a cumsum over the rows: not row by row, so left as it is (gathered)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        t, b, d = x.shape[1], x.shape[0], x.shape[2]
        rows = self.a(x.transpose(0, 1).reshape(t * b, d)).cumsum(0)
        return rows.view(t, b, d).transpose(0, 1)


def test_rows_used_otherwise_are_left_alone(monkeypatch):
    counts = []
    real = capture_mod.reorder_batch_inner_merges
    monkeypatch.setattr(capture_mod, "reorder_batch_inner_merges", lambda gm: counts.append(real(gm)) or counts[-1])
    torch.manual_seed(0)
    x, y = torch.randn(B, T, D), torch.randn(B, T, D)
    train_simulated(_RowsUsedOtherwise(), (x, y), F.mse_loss, 2, _plan("dp", "rows", None, 2), lr=0.01)
    assert counts and not any(counts), counts


def test_batch_outer_merges_are_left_alone(monkeypatch):
    """[B, T, D] -> [B*T, D] (every batch-first Linear) already keeps the split: nothing to reorder."""
    from test_capture_edge_cases import _plan as plan_of

    counts = []
    real = capture_mod.reorder_batch_inner_merges
    monkeypatch.setattr(capture_mod, "reorder_batch_inner_merges", lambda gm: counts.append(real(gm)) or counts[-1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    x, y = torch.randn(B, T, D), torch.randn(B, T, D)
    train_simulated(model, (x, y), F.mse_loss, 2, plan_of("dp", "seq", None, 2))
    assert counts and not any(counts), counts


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_encoder_under_adaptdist_train_like_eager(plan, tmp_path):
    """``adaptdist train tests/models.py:transformer_encoder`` on 2 gloo ranks: 3 SGD steps give eager's losses and
    parameters (model.safetensors)."""
    from pathlib import Path

    from adaptdist.cli import main
    from test_capture_edge_cases import assert_train_equals_eager_sgd

    out = tmp_path / "run"
    file = Path(__file__).with_name("models.py")
    rc = main(["train", f"{file}:transformer_encoder", "--nproc", "2", "--plan", plan, "--batch-size", "4",
               "--seq-len", "5", "--steps", "3", "--lr", "0.1", "--optimizer", "sgd", "--sample-bytes", "0",
               "--out", str(out), "--threads-per-rank", "1", "--timeout-s", "120"])
    assert rc == 0
    assert_train_equals_eager_sgd(out, *transformer_encoder(4, 5), 0.1, 3)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("batch_size,world", [(5, 2), (7, 3), (4, 3)])
def test_encoder_with_uneven_batch_keeps_the_split(plan, batch_size, world):
    """Uneven rows (5 on 2 ranks: 3 + 2; 4 on 3: 2 + 2 + 0): numbers as eager's, and no activation gathered: the
    per-head view [B*H, T, hd] -> [B, H, T, hd] finds each rank's rows through the LayerNorm before the attention
    (a multi-output op's getitem: sharding_rules.shard_origin; once it fell back to torch.chunk's rows of B*H and
    gathered q, k and v)."""
    progs = train_simulated(*encoder(batch_size, T), world, _plan(plan, "encoder", None, world))
    coll = _collectives(progs[0])
    assert "all_to_all_single" not in coll, coll
    assert all(re.fullmatch(r"f32\[\d+\]", s) for s in coll.get("all_gather_into_tensor", [])), coll
    chunk = [len(c) for c in torch.arange(batch_size).chunk(world)] + [0] * world
    for r, p in progs.items():
        assert _row_counts(p) <= {chunk[r] * T}, (r, _row_counts(p))
