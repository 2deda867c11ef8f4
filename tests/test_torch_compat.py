"""adaptdist/_torch_compat.py's fallbacks for a torch that lacks a newer private name (torch 2.11 on the GPU
machine of benchmarks/device_check.sh): each fallback run here with the newer name taken away."""

import torch

from adaptdist import _torch_compat as compat


def test_compile_session_without_torch_helper(monkeypatch):
    monkeypatch.delattr(torch.compiler, "_compile_session_context", raising=False)
    assert not torch.compiler.is_compiling()
    with compat.compile_session():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


def test_dtensor_strategies_without_single_dim_registry(monkeypatch):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    prop = DTensor._op_dispatcher.sharding_propagator
    a, b = torch.empty(4, 6), torch.empty(6, 8)
    with_registry = compat.dtensor_strategies(torch.ops.aten.mm.default, (a, b), {})
    monkeypatch.delattr(type(prop), "op_single_dim_strategy_funcs", raising=False)
    monkeypatch.delattr(prop, "op_single_dim_strategy_funcs", raising=False)
    without = compat.dtensor_strategies(torch.ops.aten.mm.default, (a, b), {})
    assert without is not None and with_registry is not None
    # mm's row-parallel strategy is there either way: out Shard(0) from (Shard(0), Replicate())
    for rows in (with_registry, without):
        assert any(out == [Shard(0)] and ins == [Shard(0), Replicate()] for out, ins in rows), rows
