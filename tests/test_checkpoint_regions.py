"""adaptdist/compiler/checkpoint_regions.py: a user's ``torch.utils.checkpoint.checkpoint(block, x,
use_reentrant=False)`` through the torch.compile backend is recomputed in the backward.

One process, the backend's capture for 1 rank (its vmap over ranks included) lowered under dp: the backward part
of the rank program recomputes each checkpointed block and keeps none of its internals (the saved values are the
blocks' inputs and outputs); the planner's memory estimate and the peak measured running the forward then the
backward part (:class:`adaptdist.runtime.memory.PeakMemory`) both drop. Numbers against eager with checkpointing, on 1
and 2 gloo ranks: tests/test_activation_checkpointing.py::test_user_checkpoint_through_the_backend_*.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.compiler.partition import split_forward_backward
from adaptdist.cost_models.estimate import estimate_programs
from adaptdist.cost_models.hardware import FixedCluster
from adaptdist.lowering_options import LoweringOptions
from adaptdist.runtime.memory import PeakMemory


class Block(nn.Module):
    """x [N, d] -> x + fc2(gelu(fc1(x))) (hidden 4d): three [N, 4d] activations inside."""

    def __init__(self, d: int, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.p = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), p

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.p:
            h = F.dropout(h, self.p)
        return x + self.fc2(torch.tanh(h))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 4, ckpt: bool = True, p: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.head = nn.Linear(d, d)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


def _capture(ckpt: bool, world: int = 1, tokens: int = 512, **kw):
    """The backend's joint graph of ``Net(ckpt=ckpt, **kw)`` on ``tokens`` rows per rank, for ``world`` ranks."""
    seen = {}

    def capture_only(gm, example_inputs):
        seen["captured"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), world)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    torch.compile(Net(ckpt=ckpt, **kw), backend=capture_only, dynamic=False)(torch.randn(tokens, 64))
    torch._dynamo.reset()
    return seen["captured"]


def _programs(ckpt: bool, world: int = 1, tokens: int = 512, **kw):
    captured = _capture(ckpt, world, tokens, **kw)
    return lower(captured, resolve_plan(ManualPlan.parse("dp"), captured, world, None),
                 LoweringOptions.from_mb(None, front_end="backend"))


def _count(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == op)


def _run_split(split) -> int:
    """Peak bytes of running the forward part then the backward part on random inputs (beyond the inputs)."""
    def inputs(gm):
        return [torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in gm.graph.find_nodes(op="placeholder")]

    fw_in = inputs(split.forward)
    bw_in = inputs(split.backward)[split.num_saved:]
    with PeakMemory([fw_in, bw_in]) as pm:
        outs = split.forward(*fw_in)
        saved = list(outs[len(outs) - split.num_saved:])
        del outs
        split.backward(*saved, *bw_in)
        del saved
    return pm.report.peak_bytes


def test_checkpointed_blocks_are_recomputed_in_the_backward_and_memory_drops():
    aten = torch.ops.aten
    plain, ckpt = _programs(False)[0], _programs(True)[0]
    parts = {}
    for name, p in (("plain", plain), ("ckpt", ckpt)):
        parts[name] = split_forward_backward(p.graph_module, ("out:", "buffer:"))
    # the backward recomputes each block's fc1, gelu and tanh (4 blocks); without checkpointing it computes none
    for op in (aten.gelu.default, aten.tanh.default):
        assert _count(parts["ckpt"].backward, op) == 4 and _count(parts["plain"].backward, op) == 0, op
        assert _count(parts["ckpt"].forward, op) == _count(parts["plain"].forward, op) == 4
    # saved for the backward: each block's input (and the head's), no [N, 4d] activation of a block
    saved = [n.meta["val"] for n in parts["ckpt"].backward.graph.find_nodes(op="placeholder")][:parts["ckpt"].num_saved]
    assert not any(v.shape[-1] == 256 for v in saved if v.dim() > 1), [tuple(v.shape) for v in saved]
    assert any(v.shape[-1] == 256 for v in
               [n.meta["val"] for n in parts["plain"].backward.graph.find_nodes(op="placeholder")][:parts["plain"].num_saved])
    cluster = FixedCluster.uniform([("h", 1)])
    est = {k: estimate_programs({0: p}, cluster, "sgd").peak_memory_bytes for k, p in (("plain", plain), ("ckpt", ckpt))}
    meas = {k: _run_split(s) for k, s in parts.items()}
    print(f"peak MiB estimated plain {est['plain'] / 2**20:.2f} ckpt {est['ckpt'] / 2**20:.2f}; "
          f"measured plain {meas['plain'] / 2**20:.2f} ckpt {meas['ckpt'] / 2**20:.2f}")
    assert est["ckpt"] < 0.8 * est["plain"], est
    assert meas["ckpt"] < 0.8 * meas["plain"], meas


def test_a_region_with_dropout_recomputes_with_the_forwards_mask():
    """Recomputing dropout would draw another mask: the draw (``bernoulli``) stays in the forward, and the backward's
    recomputation reads it; the program with checkpointing gives the values and gradients of the one without
    (the same draws from the same seed)."""
    aten = torch.ops.aten
    progs = {ckpt: _programs(ckpt, tokens=8, n=2, p=0.5)[0] for ckpt in (False, True)}
    split = split_forward_backward(progs[True].graph_module, ("out:", "buffer:"))
    assert _count(split.backward, aten.bernoulli.p) == 0 and _count(split.forward, aten.bernoulli.p) == 2
    assert _count(split.backward, aten.gelu.default) == 2
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(n.meta["val"].shape, generator=g) for n in progs[True].graph_module.graph.find_nodes(op="placeholder")]
    outs = {}
    for ckpt, p in progs.items():
        torch.manual_seed(0)
        outs[ckpt] = p.graph_module(*args)
    for want, got in zip(outs[False], outs[True]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_planner_memory_estimate_sees_checkpointing():
    """The automatic plan's predicted peak memory per rank (2 ranks) is lower with the checkpointed blocks."""
    from adaptdist.compiler.planner import plan_auto

    cluster = FixedCluster.uniform([("h", 2)])
    mem = {ckpt: plan_auto(_capture(ckpt, world=2), cluster, optimizer="sgd").predicted.memory_bytes
           for ckpt in (False, True)}
    print(f"planner's peak MiB per rank: plain {mem[False] / 2**20:.2f}, checkpointed {mem[True] / 2**20:.2f}")
    assert mem[True] < 0.8 * mem[False], mem
