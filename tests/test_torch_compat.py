"""adaptdist/_torch_compat.py's fallbacks for a torch that lacks a newer private name (torch 2.11 on the GPU
machine of benchmarks/device_check.sh): each fallback run here with the newer name taken away."""

import time

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


def test_elastic_launch_config_sets_the_grace_where_torch_takes_one(monkeypatch):
    import dataclasses

    import torch.distributed.launcher.api as launcher_api

    cfg = compat.elastic_launch_config(12.4, min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="r")
    assert (cfg.nproc_per_node, cfg.run_id) == (2, "r")
    if compat.elastic_shutdown_timeout_supported():  # torch 2.13
        assert cfg.shutdown_timeout == 12
        assert compat.torchrun_shutdown_timeout_args(0.2) == ["--shutdown-timeout", "1"]
        from torch.distributed.run import get_args_parser
        assert get_args_parser().parse_args(
            [*compat.torchrun_shutdown_timeout_args(7), "-m", "x"]).shutdown_timeout == 7

    # torch 2.11's LaunchConfig: the same fields less shutdown_timeout
    @dataclasses.dataclass
    class OldLaunchConfig:
        min_nodes: int
        max_nodes: int
        nproc_per_node: int
        run_id: str = ""

    monkeypatch.setattr(launcher_api, "LaunchConfig", OldLaunchConfig)
    assert not compat.elastic_shutdown_timeout_supported()
    assert compat.torchrun_shutdown_timeout_args(12.4) == []
    cfg = compat.elastic_launch_config(12.4, min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="r")
    assert cfg == OldLaunchConfig(1, 1, 2, "r")


def test_stop_rendezvous_heartbeats_stops_torch_elastics_keep_alive_timer():
    """torch's own timer class, named as its rendezvous handler names it: stopped and joined, no beat after."""
    import threading
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    beats = []
    timer = _PeriodicTimer(timedelta(seconds=0.01), lambda: beats.append(1))
    timer.set_name("RendezvousKeepAliveTimer_0")
    timer.start()
    deadline = time.monotonic() + 10
    while not beats:
        assert time.monotonic() < deadline, "the timer never beat"
        time.sleep(0.01)
    assert compat.stop_rendezvous_heartbeats() == 1
    assert not any(t.name == "RendezvousKeepAliveTimer_0" for t in threading.enumerate())
    n = len(beats)
    time.sleep(0.05)
    assert len(beats) == n
    assert compat.stop_rendezvous_heartbeats() == 0
