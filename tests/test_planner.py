"""The global planner on fake (meta) models at large world sizes: no processes, no real memory.

It must rediscover data parallelism, FSDP/ZeRO-like sharding and Megatron tensor parallelism
where each is the right answer, agree with brute force on toy problems, be deterministic, and
fail with a PlanInfeasibleError that names what conflicts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.compiler.capture import capture
from adaptdist.compiler.planner import Constraints, plan_auto
from adaptdist.compiler.planner.ilp import brute_force, solve
from adaptdist.compiler.planner.problem import AxisProblem, ClassVar, EdgeVar, axis_links, reshard_time_s
from adaptdist.cost_models.hardware import AlphaBeta, DeviceFigures, FixedCluster, LinkFigures
from adaptdist.errors import PlanInfeasibleError
from adaptdist.mesh import Mesh
from adaptdist.placement import Partial, Replicate, Shard
from adaptdist.strategy import Strategy


class ResidualMLP(nn.Module):
    """``depth`` residual blocks ``x + W2 relu(W1 x)``; ``x: [B, d]``."""

    def __init__(self, d: int, hidden: int, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
                                    for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def gpus(hosts: int, per_host: int, memory_bytes: int = 80 * 10**9) -> FixedCluster:
    """Hosts of ``per_host`` GPUs: 450 GB/s inside a host, 50 GB/s between hosts (the issue's cluster)."""
    cl = FixedCluster.uniform([(f"h{i}", per_host) for i in range(hosts)], kind="cuda", memory_bytes=memory_bytes)
    return dataclasses.replace(cl, intra_host=LinkFigures("intra_host", 450e9, 5e-6),
                               inter_host=LinkFigures("inter_host", 50e9, 1e-5))


def mlp_step(d: int, hidden: int, depth: int, batch: int):
    with torch.device("meta"):
        model = ResidualMLP(d, hidden, depth)
    x = torch.zeros(batch, d, device="meta")
    return capture(model, (x, x), F.mse_loss)


def weights(plan):
    """{fqn: placements} of the 2-D weights (biases are small enough that either choice costs nothing)."""
    return {f: p for f, p in plan.param_placements.items() if f.endswith(".weight")}


def test_small_model_with_a_large_batch_is_data_parallel():
    result = plan_auto(mlp_step(64, 256, 2, 65536), gpus(1, 8))
    assert dict(result.plan.mesh) == {"dp": 8} and result.plan.batch_axis == "dp"
    assert weights(result.plan) == {}  # every weight replicated: gradients all-reduced
    assert result.predicted.fits


def test_data_parallel_at_256_ranks():
    result = plan_auto(mlp_step(64, 256, 2, 65536), gpus(32, 8), mesh=Mesh.parse("dp=256"))
    assert result.plan.batch_axis == "dp" and weights(result.plan) == {}
    searched = plan_auto(mlp_step(64, 256, 2, 65536), gpus(32, 8))
    assert searched.plan.batch_axis == "dp" and searched.plan.mesh_spec.world_size == 256
    assert searched.predicted.step_s <= result.predicted.step_s * (1 + 1e-9)  # the search may only do better


def test_parameters_beyond_one_device_are_sharded_like_fsdp():
    """Adam state of 8 layers 1024x4096 (1.1 GB with parameters and gradients) plus activations do not
    fit 2 GB replicated; with a batch of 65536 rows sharding parameters over the batch axis (FSDP)
    moves far less than tensor parallelism would (whose activations are 256 MB per layer)."""
    step = mlp_step(1024, 4096, 8, 65536)
    roomy = plan_auto(step, gpus(1, 8))
    tight = plan_auto(step, gpus(1, 8, memory_bytes=2 * 10**9))
    assert roomy.predicted.memory_bytes > 2 * 10**9  # replicated, it would not fit
    assert tight.plan.batch_axis == "dp" and dict(tight.plan.mesh) == {"dp": 8}
    w = weights(tight.plan)
    assert len(w) >= 12 and all(isinstance(p[0], Shard) for p in w.values()), w
    assert tight.predicted.memory_bytes <= 2 * 10**9


def test_wide_layers_with_a_small_batch_on_fast_links_are_tensor_parallel():
    result = plan_auto(mlp_step(8192, 32768, 2, 8), gpus(1, 8))
    assert result.plan.batch_axis is None  # no data parallelism: 8 rows are nothing to split
    w = weights(result.plan)
    for i in range(2):  # Megatron: column-parallel first linear, row-parallel second
        assert w[f"layers.{i}.0.weight"] == (Shard(0),) and w[f"layers.{i}.2.weight"] == (Shard(1),), w


class LinearStack(nn.Module):
    """``depth`` x (Linear(d, d) + ReLU), no residual: every layer is like every other."""

    def __init__(self, d: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
        return x


def test_a_stack_of_identical_linears_alternates_column_and_row_parallel():
    """Identical layers share their decisions, but not across layer parity: Megatron's pairs (even layers
    column-parallel, odd layers row-parallel: one all_reduce per pair) stay reachable, and beat every layer
    column-parallel (an all_gather per layer forward, a reduce_scatter per layer backward)."""
    with torch.device("meta"):
        model = LinearStack(8192, 4)
    x = torch.zeros(8, 8192, device="meta")
    step = capture(model, (x, x), F.mse_loss)
    result = plan_auto(step, gpus(1, 2))
    assert dict(result.plan.mesh) == {"tp": 2}
    assert weights(result.plan) == {f"layers.{i}.weight": (Shard(i % 2),) for i in range(4)}
    columns = plan_auto(step, gpus(1, 2), mesh=Mesh.parse("tp=2"),
                        constraints=Constraints(pins={"layers.*.weight": {"tp": "S(0)"}}))
    assert result.predicted.step_s < columns.predicted.step_s


def test_each_collective_is_priced_at_its_own_calibrated_fit():
    """On a calibrated cluster a reshard costs what its own collective measured (a whole-collective fit
    ``alpha + beta * bytes`` on 2 ranks), not the all_gather's fit through the ring formulas: there gloo's
    all_reduce of a tensor is cheaper than its all_gather plus its reduce_scatter."""
    fits = {("all_reduce", "intra_host"): AlphaBeta(1.4e-3, 1.1e-9, 2),
            ("all_gather", "intra_host"): AlphaBeta(0.9e-3, 0.8e-9, 2),
            ("reduce_scatter", "intra_host"): AlphaBeta(1.4e-3, 1.4e-9, 2)}
    links = axis_links(dataclasses.replace(gpus(1, 2), fits=fits), [0, 1])
    n = 2**20
    r, s, p = Replicate(), Shard(1), Partial()
    assert reshard_time_s(p, r, n, 2, 0.0, 0.0, links=links) == pytest.approx(1.4e-3 + 1.1e-9 * n)
    assert reshard_time_s(s, r, n, 2, 0.0, 0.0, links=links) == pytest.approx(0.9e-3 + 0.8e-9 * n)
    assert reshard_time_s(p, s, n, 2, 0.0, 0.0, links=links) == pytest.approx(1.4e-3 + 1.4e-9 * n)
    assert reshard_time_s(p, r, n, 2, 0.0, 0.0, frozenset({"all_reduce"}), links) == pytest.approx(1.1e-9 * n)
    plain = axis_links(gpus(1, 2), [0, 1])  # uncalibrated: every kind at the link's latency and bandwidth
    assert not plain["all_reduce"].calibrated and plain["all_reduce"].alpha_s == plain["all_gather"].alpha_s


def test_plan_is_deterministic():
    step = mlp_step(256, 1024, 2, 64)
    a = plan_auto(step, gpus(1, 4)).plan.to_json()
    b = plan_auto(step, gpus(1, 4)).plan.to_json()
    assert a == b


def test_repeated_layers_share_decisions():
    """The ILP has as many decisions for 16 layers as for 8: identical blocks share them (only the
    first and last layers, whose neighbourhoods differ, have classes of their own; a class is split
    once, by the parity of its layer, so consecutive layers may alternate)."""
    small = plan_auto(mlp_step(64, 256, 8, 512), gpus(1, 2), mesh=Mesh.parse("dp=2"))
    deep = plan_auto(mlp_step(64, 256, 16, 512), gpus(1, 2), mesh=Mesh.parse("dp=2"))
    n_small = len(small.axes["dp"].problem.vars)
    n_deep = len(deep.axes["dp"].problem.vars)
    assert len(deep.graph.nodes) > 1.8 * len(small.graph.nodes)
    assert n_deep <= n_small + 5, (n_small, n_deep)


def test_heterogeneous_cluster_uses_the_smallest_memory_and_the_slowest_device():
    fast = DeviceFigures(0, "h0", "cuda", {"float32": 19.5e12}, 80 * 10**9, 2e12)
    slow = DeviceFigures(1, "h0", "cuda", {"float32": 9.75e12}, 16 * 10**9, 1e12)
    link = LinkFigures("intra_host", 450e9, 5e-6)
    mixed = FixedCluster((fast, slow), link, LinkFigures("inter_host", 50e9, 1e-5))
    same = FixedCluster((fast, dataclasses.replace(fast, rank=1)), link, LinkFigures("inter_host", 50e9, 1e-5))
    step = mlp_step(1024, 4096, 2, 4096)
    r_mixed, r_same = plan_auto(step, mixed), plan_auto(step, same)
    assert r_mixed.predicted.capacity_bytes == 16 * 10**9
    assert r_mixed.predicted.compute_s == pytest.approx(2 * r_same.predicted.compute_s, rel=0.05)


def test_contradictory_pins_name_both():
    step = mlp_step(64, 256, 2, 512)
    pins = Constraints(pins={"layers.*.0.weight": {"tp": "S(0)"}, "layers.0.0.weight": {"tp": "S(1)"}})
    with pytest.raises(PlanInfeasibleError, match=r"layers\.\*\.0\.weight.*layers\.0\.0\.weight"):
        plan_auto(step, gpus(1, 2), constraints=pins)


def test_pin_that_no_strategy_allows_names_the_node():
    step = mlp_step(64, 256, 2, 512)
    with pytest.raises(PlanInfeasibleError, match=r"S\(5\).*layers\.0\.0\.weight"):
        plan_auto(step, gpus(1, 2), mesh=Mesh.parse("tp=2"),
                  constraints=Constraints(pins={"layers.0.0.weight": {"tp": "S(5)"}}))


def test_pins_and_forbidden_axes_are_obeyed():
    step = mlp_step(8192, 32768, 2, 8)
    pinned = plan_auto(step, gpus(1, 8), mesh=Mesh.parse("tp=8"),
                       constraints=Constraints(pins={"layers.0.0.weight": {"tp": "R"}}))
    assert "layers.0.0.weight" not in pinned.plan.param_placements
    assert pinned.plan.param_placements["layers.1.0.weight"] == (Shard(0),)  # layer 1 is a class of its own now


def test_impossible_memory_names_the_device_and_the_sizes():
    step = mlp_step(1024, 4096, 8, 65536)
    with pytest.raises(PlanInfeasibleError, match=r"rank 0 \(cuda on h0\) holds 95\.4 MiB.*optimizer state.*activations"):
        plan_auto(step, gpus(1, 8, memory_bytes=10**8))


def _toy(seed: int) -> AxisProblem:
    """A random problem of 6 decisions with 2-4 strategies, random compute, resharding and memory."""
    rng = random.Random(seed)
    places = [Replicate(), Shard(0), Shard(1), Partial()]
    vars_ = []
    for i in range(6):
        k = rng.randint(2, 4)
        strats = [Strategy((), (places[j],), "adaptdist") for j in range(k)]
        vars_.append(ClassVar(f"v{i}", [f"v{i}"], strats, [rng.uniform(0, 1e-3) for _ in range(k)],
                              [[rng.uniform(0, 10) for _ in range(k)]], list(range(k))))
    edges = []
    for _ in range(8):
        a, b = rng.sample(range(6), 2)
        ka, kb = len(vars_[a].strategies), len(vars_[b].strategies)
        edges.append(EdgeVar(a, b, places[:ka], places[:kb], list(range(ka)), list(range(kb)),
                             [[0.0 if p == q else rng.uniform(0, 1e-3) for q in range(kb)] for p in range(ka)]))
    return AxisProblem("tp", 2, vars_, edges, capacity_bytes=35.0, fixed_bytes=[0.0], peak_steps=[0],
                       var_of={f"v{i}": i for i in range(6)}, alpha_s=0.0, beta_s_per_byte=0.0)


@pytest.mark.parametrize("seed", range(12))
def test_ilp_objective_equals_brute_force_on_toy_problems(seed):
    problem = _toy(seed)
    choice, best = brute_force(problem)
    result = solve(problem)
    assert result.status == "optimal"
    assert problem.memory_ok(result.choice)
    assert result.objective_s == pytest.approx(best, abs=2e-9 * len(problem.vars))


def _tie(split_saves_s: float, gather_s: float, gather_bytes: float) -> AxisProblem:
    """Two decisions: a layer that runs whole (strategy 0) or column-parallel (strategy 1, saving ``split_saves_s``
    of compute), and its consumer, which needs the output whole: the split pays an all_gather of ``gather_s``
    seconds moving ``gather_bytes``; the unsplit layer's output needs nothing."""
    whole, cols = Strategy((), (Replicate(),), "adaptdist"), Strategy((), (Shard(1),), "adaptdist")
    layer = ClassVar("fc", ["fc"], [whole, cols], [2e-6, 2e-6 - split_saves_s], [[0.0, 0.0]], [0, 1])
    use = ClassVar("relu", ["relu"], [Strategy((Replicate(),), (Replicate(),), "adaptdist")], [1e-6], [[0.0]], [0])
    use2 = ClassVar("out", ["out"], [Strategy((Replicate(),), (Replicate(),), "adaptdist"),
                                     Strategy((Shard(1),), (Shard(1),), "adaptdist")], [1e-6, 1e-6], [[0.0, 0.0]],
                    [0, 1])
    # the edge fc -> out with both ends free (an edge variable), and fc -> relu with relu decided (a unary cost)
    edge = EdgeVar(0, 2, [Replicate(), Shard(1)], [Replicate(), Shard(1)], [0, 1], [0, 1],
                   [[0.0, 0.0], [gather_s, 0.0]], ["fc->out"], [[0.0, 0.0], [gather_bytes, 0.0]])
    unary = EdgeVar(0, 1, [Replicate(), Shard(1)], [Replicate()], [0, 1], [0],
                    [[0.0], [gather_s]], ["fc->relu"], [[0.0], [gather_bytes]])
    use2.reshard_s = [0.0, 5e-9]  # out sharded pays a reshard into the loss: out stays whole
    return AxisProblem("tp", 2, [layer, use, use2], [edge, unary], capacity_bytes=1.0, fixed_bytes=[0.0],
                       peak_steps=[0], var_of={"fc": 0, "relu": 1, "out": 2}, alpha_s=0.0, beta_s_per_byte=0.0)


def test_ilp_breaks_a_tie_toward_less_communication():
    """Equal predicted time (the split's saved compute pays exactly for its two gathers, as a tiny column-parallel
    layer's all_gather under the shared-memory estimate prices at about 0): the choice that moves no bytes wins,
    whatever the order of the strategies; brute force agrees."""
    problem = _tie(split_saves_s=2e-9, gather_s=1e-9, gather_bytes=256.0)
    assert problem.objective_s((0, 0, 0)) == pytest.approx(problem.objective_s((1, 0, 0)), abs=1e-15)
    assert problem.communication_bytes((1, 0, 0)) == 512.0 and problem.communication_bytes((0, 0, 0)) == 0.0
    assert solve(problem).choice == (0, 0, 0)
    assert brute_force(problem)[0] == (0, 0, 0)
    # the same with the strategies listed the other way round: the tie-break, not the order, decides
    swapped = _tie(split_saves_s=2e-9, gather_s=1e-9, gather_bytes=256.0)
    v = swapped.vars[0]
    v.strategies.reverse(), v.compute_s.reverse(), v.memory_bytes[0].reverse()
    for e in swapped.edges:
        e.src_of = [1, 0]
    assert solve(swapped).choice == (1, 0, 0)  # index 1 is now the unsplit layer


def test_ilp_tie_break_never_outweighs_a_real_time_difference():
    """One objective unit (1 ns) faster wins even when it moves a terabyte and the other choice nothing: the
    tie-break's whole term stays under half a unit (ilp.TIE_BREAK_UNITS)."""
    problem = _tie(split_saves_s=3e-9, gather_s=1e-9, gather_bytes=1e12)
    assert problem.objective_s((1, 0, 0)) < problem.objective_s((0, 0, 0))
    assert solve(problem).choice == (1, 0, 0)
    assert brute_force(problem)[0] == (1, 0, 0)


def _bucketed(saves_s: float, layers: int) -> AxisProblem:
    """``layers`` parameters that may each be sharded (strategy 1, saving ``saves_s`` of optimizer-like compute) at the
    price of a bucketed all_gather (no per-tensor latency) into its whole-weight user; the bucket's latency is 10 ns."""
    R, S = Replicate(), Shard(0)
    vars_, edges = [], []
    for i in range(layers):
        vars_.append(ClassVar(f"w{i}", [f"w{i}"], [Strategy((), (R,), "adaptdist"), Strategy((), (S,), "adaptdist")],
                              [10e-9, 10e-9 - saves_s], [[0.0, 0.0]], [0, 1]))
        vars_.append(ClassVar(f"mm{i}", [f"mm{i}"], [Strategy((R,), (R,), "adaptdist"), Strategy((S,), (S,), "adaptdist")],
                              [5e-9, 5e-9], [[0.0, 0.0]], [0, 1], reshard_s=[0.0, 100e-9]))
        edges.append(EdgeVar(2 * i, 2 * i + 1, [R, S], [R, S], [0, 1], [0, 1], [[0.0, 0.0], [1e-9, 0.0]],
                             [f"w{i}->mm{i}"], [[0.0, 0.0], [64.0, 0.0]], [["", ""], ["all_gather", ""]]))
    return AxisProblem("tp", 2, vars_, edges, capacity_bytes=1.0, fixed_bytes=[0.0], peak_steps=[0],
                       var_of={v.key: i for i, v in enumerate(vars_)}, alpha_s=0.0, beta_s_per_byte=0.0,
                       bucket_latency_s={"all_gather": 10e-9})


def test_ilp_pays_a_buckets_latency_once_for_all_its_tensors():
    """Bucketed collectives share one message: sharding one parameter (saves 7 ns, gathers for 1 ns + the bucket's
    10 ns) does not pay, sharding both does (14 ns saved, 2 ns + one 10 ns latency); brute force agrees."""
    one = _bucketed(7e-9, 1)
    assert solve(one).choice == (0, 0) and brute_force(one)[0] == (0, 0)
    two = _bucketed(7e-9, 2)
    best = (1, 0, 1, 0)
    assert solve(two).choice == best and brute_force(two)[0] == best
    assert two.communication_s(best) == pytest.approx(12e-9) and two.buckets(best) == {"all_gather"}
    assert two.objective_s(best) < two.objective_s((0, 0, 0, 0)) < two.objective_s((1, 0, 0, 0))


def test_warm_start_from_a_previous_plan_gives_the_same_plan():
    step = mlp_step(8192, 32768, 2, 8)
    first = plan_auto(step, gpus(1, 8), mesh=Mesh.parse("tp=8"))
    again = plan_auto(step, gpus(1, 8), mesh=Mesh.parse("tp=8"), previous=first.plan)
    assert again.plan.to_json() == first.plan.to_json()
