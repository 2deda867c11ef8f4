"""The inter-stage planner (adaptdist/compiler/planner/stages.py, layers.py) and the schedule model
(adaptdist/cost_models/pipeline.py): the DP against brute force, sub-mesh pruning, the schedule formulas and
choice, memory refusals, pipeline vs data parallelism in the cost model, the layers of a real graph."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.compiler.capture import capture
from adaptdist.compiler.planner.graph import build_planning_graph
from adaptdist.compiler.planner.layers import Layer, LayerGraph, build_layers, layer_key
from adaptdist.compiler.planner.stages import (PipelineChoice, StageCoster, StageEstimate, StageSlot,
                                               brute_force_stages, plan_pipeline, plan_stages, solve_stages,
                                               stage_plan_lines, submesh_sizes)
from adaptdist.cost_models.hardware import FixedCluster
from adaptdist.cost_models.pipeline import in_flight_microbatches, schedule_estimate
from adaptdist.errors import PlanInfeasibleError

from models import tiny_gpt


# --- synthetic layers -------------------------------------------------------------------------------

def synthetic(costs, batch_size=16, send_bytes=0):
    """A LayerGraph of layers with (forward_s, backward_s, weight_s, state_bytes, activation_bytes) each (whole
    batch), and a coster: a range on k ranks is data-parallel (compute / k, a ring all_reduce of its state / 4
    as gradients at 1 GB/s, activations / k)."""
    layers = []
    for i, (f, b, w, state, act) in enumerate(costs):
        L = Layer(f"l{i}", i, forward_s=f, backward_s=b, weight_s=w, ops=(1, 1, 1), param_bytes=state,
                  trainable_bytes=state, saved_bytes=act, signature=f"s{i}")
        L.state, L.act = state, act
        layers.append(L)
    n = len(layers)
    lg = LayerGraph(SimpleNamespace(batch_size=batch_size), layers, {}, [send_bytes] * (n - 1), [send_bytes] * (n - 1),
                    n - 1)

    def coster(first, end, ranks):
        ls, k = layers[first:end], len(ranks)
        c = [sum(x.forward_s for x in ls), sum(x.backward_s for x in ls), sum(x.weight_s for x in ls)]
        tot = sum(c)
        grads = sum(x.state for x in ls) / 4
        sync = 2 * (k - 1) / k * grads / 1e9 if k > 1 else 0.0
        return StageEstimate(tot / k, tuple(x / tot for x in c), 0.0, (1 / 3, 1 / 3, 1 / 3), sync,
                             sum(x.state for x in ls), sum(x.act for x in ls) / k, (("dp", k),), "dp", "analytic")

    return lg, coster


def cpu(n, hosts=1, memory_bytes=None):
    return FixedCluster.uniform([(f"h{i}", n // hosts) for i in range(hosts)], memory_bytes=memory_bytes)


# --- the DP against brute force ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force_on_random_layer_costs(seed):
    rng = random.Random(seed)
    L, D = rng.randint(2, 5), rng.choice([2, 3, 4])
    m = rng.choice([2, 3, 4, 8])
    cl = cpu(D, hosts=rng.choice([h for h in (1, 2) if D % h == 0]))
    lat = {}
    state = {}
    for off in range(D):
        for k in submesh_sizes(cl, off, D - off):
            for a in range(L):
                for b in range(a + 1, L + 1):
                    lat[StageSlot(a, b, off, k)] = rng.uniform(0.5, 3.0) * (b - a) / k ** rng.uniform(0.3, 1.0)
                    state[StageSlot(a, b, off, k)] = (rng.uniform(0, 1), rng.uniform(0, 0.5))
    cap = rng.uniform(0.6, 2.5)

    def latency(slot):
        return lat.get(slot)

    def memory_ok(slot, s):
        st, act = state[slot]
        return st + min(m, s) * act <= cap

    def sizes(off, rem):
        return submesh_sizes(cl, off, rem)

    want = brute_force_stages(L, D, latency, memory_ok, sizes, m)
    got = solve_stages(L, D, latency, memory_ok, sizes, m, epsilon=0.0)
    if want is None:
        assert got is None
        return
    assert got is not None and got.latency_s == pytest.approx(want, rel=1e-12)
    assert sum(s.size for s in got.slots) == D and got.slots[-1].end == L
    assert [s.first for s in got.slots[1:]] == [s.end for s in got.slots[:-1]]
    assert got.latency_s == pytest.approx(sum(got.times_s) + (m - 1) * max(got.times_s))


def test_dp_with_epsilon_is_within_epsilon_of_exact():
    rng = random.Random(7)
    cl = cpu(4)
    lat = {StageSlot(a, b, off, k): rng.uniform(0.5, 3.0) * (b - a) / k
           for off in range(4) for k in submesh_sizes(cl, off, 4 - off) for a in range(6) for b in range(a + 1, 7)}

    def run(eps):
        return solve_stages(6, 4, lat.get, lambda s, n: True, lambda o, r: submesh_sizes(cl, o, r), 8, epsilon=eps)

    exact, approx = run(0.0), run(0.01)
    assert approx.latency_s <= exact.latency_s * 1.01 + 1e-12


def test_submesh_sizes_follow_alpa_pruning():
    one = cpu(8)
    assert submesh_sizes(one, 0, 8) == [1, 2, 4, 8]
    assert submesh_sizes(one, 4, 4) == [1, 2, 4]
    assert submesh_sizes(one, 5, 3) == [1, 2, 3]
    two = cpu(8, hosts=2)
    assert submesh_sizes(two, 0, 8) == [1, 2, 4, 8]  # within the host, or whole hosts
    assert submesh_sizes(two, 2, 6) == [1, 2]  # never straddles the host boundary
    assert submesh_sizes(two, 4, 4) == [1, 2, 4]


# --- the schedule model --------------------------------------------------------------------------------

def test_schedule_formulas_on_equal_stages():
    p, m, f, b, w = 4, 8, 1.0, 1.0, 1.0
    args = ([f] * p, [b] * p, [w] * p, m)
    g = schedule_estimate("gpipe", *args)
    assert g.step_s == pytest.approx((m + p - 1) * 3.0)
    assert g.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert schedule_estimate("1f1b", *args).step_s == g.step_s
    zb = schedule_estimate("zb", *args)
    assert zb.bubble_s == pytest.approx((p - 1) * (f + b - w))  # Qi et al. 2023: ZB-H1
    il = schedule_estimate("interleaved-1f1b", *args, chunks=2)
    assert il.bubble_s == pytest.approx((p - 1) * 3.0 / 2)
    assert schedule_estimate("interleaved-1f1b", [1.0] * 3, [1.0] * 3, [0.0] * 3, 4).why_not  # 4 % 3 != 0
    assert in_flight_microbatches("gpipe", 4, 8) == (8,) * 4
    assert in_flight_microbatches("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight_microbatches("1f1b", 4, 2) == (2, 2, 2, 1)


def test_zero_bubble_is_chosen_where_its_bubble_is_lower():
    cl = cpu(2)
    # a weight-gradient part as large as the input-gradient part: ZB-H1 fills the bubble with it
    lg, coster = synthetic([(1e-3, 1e-3, 1e-3, 1e6, 1e5)] * 4)
    ch = plan_stages(lg, cl, coster, microbatches=[4])
    assert ch.schedule == "zb"
    by = {s.schedule: s for s in ch.schedules}
    assert by["zb"].bubble_s < by["1f1b"].bubble_s
    # no weight-gradient work: ZB-H1 is 1F1B, and 1F1B wins the tie (same time, less memory than GPipe)
    lg0, coster0 = synthetic([(1e-3, 2e-3, 0.0, 1e6, 1e5)] * 4)
    ch0 = plan_stages(lg0, cl, coster0, microbatches=[4], schedules=("gpipe", "1f1b", "zb"))
    assert ch0.schedule == "1f1b"
    # free sends, stages far longer than the executor's host time per chunk and microbatch: interleaving halves the
    # bubble (at 1 ms layers the host time of twice the chunks outweighs it)
    lg1, coster1 = synthetic([(1e-2, 2e-2, 0.0, 1e6, 1e5)] * 4)
    assert plan_stages(lg1, cl, coster1, microbatches=[4]).schedule == "interleaved-1f1b"
    assert plan_stages(lg0, cl, coster0, microbatches=[4]).schedule == "1f1b"
    lines = "\n".join(stage_plan_lines(ch))
    assert "schedule zb" in lines and "stage 1" in lines and "why zb" in lines and "1f1b" in lines


def test_gpipe_is_not_chosen_where_its_in_flight_activations_do_not_fit():
    cl = cpu(2, memory_bytes=10 * 2**20)
    # two layers a stage: 6 MiB of state and 8 MiB of activations per batch, 1 MiB per microbatch; GPipe holds all 8
    # microbatches (14 MiB), 1F1B 2 and 1 (8 and 7 MiB); an uneven cut holds 9 MiB of state and does not fit either
    lg, coster = synthetic([(1e-3, 1e-3, 0.0, 3 * 2**20, 4 * 2**20)] * 4)
    ch = plan_stages(lg, cl, coster, microbatches=[8], schedules=("gpipe", "1f1b"))
    assert ch.schedule == "1f1b"
    for s in ch.stages:
        assert s.memory_bytes <= s.capacity_bytes
    with pytest.raises(PlanInfeasibleError):
        plan_stages(lg, cl, coster, microbatches=[8], schedules=("gpipe",))


def test_no_stage_fits_names_the_device_and_its_memory():
    cl = cpu(2, memory_bytes=2**20)
    lg, coster = synthetic([(1e-3, 1e-3, 0.0, 3 * 2**20, 2**20)] * 3)
    with pytest.raises(PlanInfeasibleError) as e:
        plan_stages(lg, cl, coster, microbatches=[2])
    msg = str(e.value)
    assert "rank 0" in msg and "1.0 MiB" in msg and "layer l0" in msg


# --- the real graph ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_layers():
    model, batch, loss_fn = tiny_gpt(batch_size=4)
    cg = capture(model, batch, loss_fn)
    pg = build_planning_graph(cg, cpu(2))
    return cg, pg, build_layers(pg)


def test_layers_of_a_gpt_follow_its_modules(gpt_layers):
    cg, pg, lg = gpt_layers
    assert lg.names == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f"]
    ops = [n for n, pn in pg.nodes.items() if pn.kind == "op"]
    assert all(n in lg.layer_of for n in ops)
    assert sorted(n for L in lg.layers for n in L.forward + L.backward + L.weight) == sorted(ops)
    act = 4 * 8 * 32 * 4  # [B, S, D] float32 crosses every boundary, forward and backward
    assert lg.forward_bytes == [act] * 4
    assert lg.backward_bytes[2] == act  # between the blocks: the residual stream's gradient only
    b0, b1 = lg.layers[2], lg.layers[3]
    assert b0.forward_s == pytest.approx(b1.forward_s) and b0.weight_s == pytest.approx(b1.weight_s, rel=0.1)
    assert lg.layers[4].reads >= {"tok_emb.weight"}  # the tied head reads the embedding on the last layer
    assert lg.loss_layer == 4
    assert layer_key("blocks.11.attn.q.weight") == "blocks.11" and layer_key("0.weight") == "0"


def test_a_models_own_tensors_are_no_layer():
    from models import tiny_llama

    model, batch, loss_fn = tiny_llama(batch_size=4)
    lg = build_layers(build_planning_graph(capture(model, batch, loss_fn), cpu(2)))
    assert lg.names == ["tok_emb", "layers.0", "layers.1", "norm", "head"]  # rope_cos/rope_sin: held where read
    act = 4 * 8 * 32 * 4
    # between the blocks: the residual stream and its RMS-normalized copy (the norm's weight-free part runs with
    # its inputs, before the cut, as pp-core's stage cut places it); the rotary table's slices are not sent
    assert lg.forward_bytes[1] == 2 * act


def wide_mlp(width, depth, batch):
    """``depth`` Linear(width, width) + ReLU on the meta device (no memory)."""
    with torch.device("meta"):
        model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(width, width), nn.ReLU())
                                                             for _ in range(depth)))
    x = torch.zeros(batch, width, device="meta")
    return capture(model, (x, x), F.mse_loss)


def data_parallel_step_s(pg, cl, optimizer="adamw"):
    """Data parallelism over every rank in the same cost model: the whole step as one range, split over the batch,
    its gradients all_reduced."""
    lg = build_layers(pg)
    e = StageCoster(lg, cl, optimizer, "analytic")(0, len(lg.layers), tuple(range(cl.world_size)))
    return e.compute_s + e.overhead_s + e.grad_sync_s, lg


def test_pipeline_beats_data_parallel_where_gradients_dwarf_activations():
    cl = FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6)  # gloo-like: 1.47 GB/s between the two ranks
    pg = build_planning_graph(wide_mlp(2048, 4, 16), cl)
    dp_s, lg = data_parallel_step_s(pg, cl)
    grads = sum(L.trainable_bytes for L in lg.layers)
    assert grads > 500 * max(lg.forward_bytes)  # 67 MB of gradients, 128 KiB of activations
    ch = plan_pipeline(None, cl, spmd_step_s=dp_s, pg=pg)
    # 0.77x: each microbatch reads the 16 MiB weights and writes and adds up their gradients (microbatch_times)
    assert ch.chosen and ch.step_s < 0.8 * dp_s
    assert ch.num_stages == 2 and all(len(s.ranks) == 1 for s in ch.stages) and ch.microbatches == 2
    assert any("pipeline is chosen" in line for line in stage_plan_lines(ch))


def test_data_parallel_wins_for_a_small_model_with_a_large_batch():
    cl = FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6)
    pg = build_planning_graph(wide_mlp(64, 4, 512), cl)
    dp_s, _ = data_parallel_step_s(pg, cl)
    ch = plan_pipeline(None, cl, spmd_step_s=dp_s, pg=pg)
    assert not ch.chosen and ch.step_s > dp_s
    assert any("not chosen" in line for line in stage_plan_lines(ch))


def test_stage_costs_come_from_the_intra_stage_ilp():
    cl = FixedCluster.uniform([("h0", 4)], op_overhead_s=5e-6)
    pg = build_planning_graph(wide_mlp(256, 4, 32), cl)
    ch = plan_pipeline(None, cl, pg=pg, num_stages=2, microbatches=[4], schedules=("1f1b",))
    assert [len(s.ranks) for s in ch.stages] == [2, 2]
    assert {s.source for s in ch.stages} == {"ilp"}
    assert [s.layers for s in ch.stages] == [("0", "2"), ("4", "6")]
    d = ch.to_dict()
    assert d["num_stages"] == 2 and d["stages"][1]["ranks"] == [2, 3] and d["schedule"] == "1f1b"
    sc = StageCoster(build_layers(pg), cl)
    first = sc(1, 2, (0, 1))
    assert sc(1, 2, (2, 3)) is first and sc.misses == 1  # the same range on like ranks: solved once
    assert sc(2, 3, (2, 3)) == first  # a like layer costs the same


def test_memory_too_small_for_any_pipeline_names_the_device():
    cl = FixedCluster.uniform([("h0", 2)], memory_bytes=64 * 2**20)
    pg = build_planning_graph(wide_mlp(2048, 4, 16), cl)  # 16 MiB of weights per layer, x4 with AdamW
    with pytest.raises(PlanInfeasibleError) as e:
        plan_pipeline(None, cl, pg=pg, coster="analytic")
    assert "rank 0 (cpu on h0) holds 64.0 MiB" in str(e.value)


@pytest.mark.timeout(300)  # a hang guard, not a speed target: the search's time is benchmarks/bench_pp_planner.py's
def test_planner_finishes_on_32_layers_and_8_ranks():
    rng = random.Random(0)
    lg, coster = synthetic([(rng.uniform(1, 2) * 1e-3, 2e-3, 1e-3, 1e6, 1e5) for _ in range(32)], batch_size=64)
    ch = plan_stages(lg, cpu(8), coster, microbatches=[8, 16, 32])
    assert isinstance(ch, PipelineChoice) and ch.num_stages >= 2


def test_uniform_sub_meshes_give_every_stage_the_same_mesh():
    cl = FixedCluster.uniform([("h0", 4)], op_overhead_s=5e-6)
    pg = build_planning_graph(wide_mlp(256, 4, 32), cl)
    ch = plan_pipeline(None, cl, pg=pg, microbatches=[4], schedules=("1f1b", "zb"), uniform=True)
    assert len({tuple(sorted(s.mesh.items())) for s in ch.stages}) == 1
    assert len({len(s.ranks) for s in ch.stages}) == 1 and sum(len(s.ranks) for s in ch.stages) == 4


# --- the automatic planner with stages -----------------------------------------------------------------

def slow_hosts():
    """Two hosts of one rank each joined by a slow link (100 MB/s): gradients and tensor-parallel activations
    cross it every step, a pipeline's activations once per microbatch."""
    import dataclasses

    from adaptdist.cost_models.hardware import LinkFigures

    cl = FixedCluster.uniform([("h0", 1), ("h1", 1)], op_overhead_s=5e-6)
    return dataclasses.replace(cl, inter_host=LinkFigures("inter_host", 1e8, 1e-4))


def test_auto_weighs_stages_and_takes_them_only_where_predicted_faster():
    from rich.console import Console

    from adaptdist.compiler.planner.summary import print_summary, run_planner

    fast = run_planner(wide_mlp(1024, 4, 16), FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6), None, "adamw",
                       pipeline=True)
    assert isinstance(fast.pipeline, PipelineChoice) and not fast.pipeline.chosen  # tensor parallel is faster
    assert getattr(fast.plan, "pipeline", None) is None and fast.plan.mesh == {"tp": 2}
    slow = run_planner(wide_mlp(1024, 4, 256), slow_hosts(), None, "adamw", pipeline=True)
    assert isinstance(slow.pipeline, PipelineChoice) and slow.pipeline.step_s < 0.9 * slow.predicted.step_s
    try:
        import adaptdist.compiler.pipeline_lowering  # noqa: F401 -- pp-core's lowering: the plan holds the stages
        assert slow.plan.pipeline is not None and slow.plan.mesh == {"pp": 2}
        assert [s.layers for s in slow.plan.pipeline.stages] == [("0", "2"), ("4", "6")]
    except ImportError:  # without it the SPMD plan stays, and the stage plan says why
        assert "not lowered" in slow.pipeline.note and "pp" not in slow.plan.mesh
    console = Console(record=True, width=200)
    print_summary(console, slow, layers=False)
    text = console.export_text()
    assert "pipeline plan: 2 stages" in text and "stage 1: layers 4 .. 6" in text and "why " in text
    assert run_planner(wide_mlp(64, 2, 8), slow_hosts(), None, "adamw").pipeline is None  # off unless asked


def test_the_automatic_pipeline_plan_lowers():
    pytest.importorskip("adaptdist.compiler.pipeline_lowering")
    from adaptdist.compiler.lowering import lower
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.compiler.planner.stages import with_pipeline
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.plan import Plan

    torch.manual_seed(0)
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(512, 512), nn.ReLU()) for _ in range(4)))
    x = torch.randn(256, 512)
    cg = capture(model, (x, x), F.mse_loss)
    result = with_pipeline(plan_auto(cg, slow_hosts()), cg, slow_hosts())
    assert result.plan.pipeline is not None
    assert Plan.from_json(result.plan.to_json()) == result.plan
    programs = lower(cg, result.plan, LoweringOptions())
    assert programs[0].schedule == result.plan.pipeline.schedule
    assert [programs[r].stages[0].layers for r in (0, 1)] == [s.layers for s in result.plan.pipeline.stages]


def test_a_faster_device_gets_more_layers():
    import dataclasses

    cl = FixedCluster.uniform([("h0", 2)], op_overhead_s=5e-6)
    fast = dataclasses.replace(cl.devices[0], peak_flops={"float32": 1e11}, memory_bandwidth_bytes_per_s=2e10)
    hetero = dataclasses.replace(cl, devices=(fast, cl.devices[1]))
    pg = build_planning_graph(wide_mlp(512, 6, 64), hetero)
    ch = plan_pipeline(None, hetero, pg=pg, microbatches=[8], schedules=("1f1b",))
    assert [len(s.ranks) for s in ch.stages] == [1, 1]
    assert len(ch.stages[0].layers) == 4 and len(ch.stages[1].layers) == 2  # twice as fast: twice the layers
    even = plan_pipeline(None, cl, pg=build_planning_graph(wide_mlp(512, 6, 64), cl), microbatches=[8],
                         schedules=("1f1b",))
    assert [len(s.layers) for s in even.stages] == [3, 3]


def test_too_few_microbatches_for_the_stages_is_not_called_a_memory_error():
    lg, coster = synthetic([(1e-3, 1e-3, 0.0, 1e3, 1e3)] * 8, batch_size=4)
    with pytest.raises(PlanInfeasibleError, match="uses all 8 ranks with at most 4 microbatches"):
        plan_stages(lg, cpu(8), coster, sizes=lambda off, rem: [1])


def test_a_pipeline_where_no_plan_without_stages_fits_memory():
    from adaptdist.compiler.planner.summary import run_planner

    # 256 MiB of activations for the whole batch, 64 MiB devices: split over the batch they still need 128 MiB;
    # a pipeline of many microbatches keeps only a few in flight
    cl = FixedCluster.uniform([("h0", 2)], memory_bytes=64 * 2**20, op_overhead_s=5e-6)
    cg = wide_mlp(256, 4, 32768)
    with pytest.raises(PlanInfeasibleError):
        run_planner(cg, cl, None, "adamw")
    try:
        import adaptdist.compiler.pipeline_lowering  # noqa: F401
    except ImportError:
        with pytest.raises(PlanInfeasibleError, match="no pipeline lowering"):
            run_planner(cg, cl, None, "adamw", pipeline=True)
        return
    result = run_planner(cg, cl, None, "adamw", pipeline=True)
    assert result.plan.pipeline is not None and isinstance(result.pipeline, PipelineChoice)
    assert all(s.memory_bytes <= s.capacity_bytes for s in result.pipeline.stages)
    assert "no SPMD plan" in result.tried[0][1]


def test_a_given_sub_mesh_is_kept():
    from adaptdist.mesh import Mesh

    cl = FixedCluster.uniform([("h0", 4)], op_overhead_s=5e-6)
    pg = build_planning_graph(wide_mlp(256, 4, 32), cl)
    ch = plan_pipeline(None, cl, pg=pg, microbatches=[4], schedules=("1f1b",), uniform=True,
                       submesh=Mesh.parse("dp=2"))
    assert [dict(s.mesh) for s in ch.stages] == [{"dp": 2}, {"dp": 2}] and ch.stages[1].ranks == (2, 3)


# --- one microbatch's time: the weight traffic every microbatch pays --------------------------------------------

def test_microbatch_times_pay_the_weight_traffic_in_every_microbatch():
    """Summed over the m microbatches of a step, a stage's F, B and W are the whole batch's compute plus (m - 1) more
    passes of the traffic that does not shrink with the microbatch, and W adds the executor's gradient sums (2 passes
    for the first microbatch's copy, 3 for each later add_); without such traffic, the whole batch's share over m."""
    from adaptdist.cost_models.pipeline import EXECUTOR_MICROBATCH_HOST_S as h, microbatch_times

    c, fr, x, g = 1.0, (0.25, 0.5, 0.25), (0.01, 0.02, 0.03), 0.004
    for m in (1, 2, 4, 8):
        f, b, w = microbatch_times(c, fr, 0.0, (1 / 3,) * 3, m, x, g)
        assert m * f == pytest.approx(0.25 + 0.01 * (m - 1) + m * h / 2)
        assert m * b == pytest.approx(0.5 + 0.02 * (m - 1) + m * h / 2)
        assert m * w == pytest.approx(0.25 + 0.03 * (m - 1) + (3 * m - 1) * g)
        assert microbatch_times(c, fr, 0.0, (1 / 3,) * 3, m) == pytest.approx((0.25 / m + h / 2, 0.5 / m + h / 2,
                                                                              0.25 / m))
        # a GPU overlaps the two: a microbatch is as slow as the slower of its share and its weight traffic
        f, _, _ = microbatch_times(c, fr, 0.0, (1 / 3,) * 3, m, x, g, overlapped=True)
        assert f == pytest.approx(max(0.25 / m, 0.01) + h / 2)
        # over 2 batch-axis replicas the whole-batch compute held the traffic once per replica's half
        f, _, _ = microbatch_times(c, fr, 0.0, (1 / 3,) * 3, m, x, 0.0, replicas=2)
        assert m * f == pytest.approx(0.25 + 0.01 * (m - 0.5) + m * h / 2)


def test_the_layers_weight_traffic_is_their_weights_and_gradients():
    """A Linear layer's forward reads its weight and bias, its input gradient the weight (not in the first layer:
    its input needs no gradient), its weight-gradient work writes both gradients: whatever the batch."""
    width = 64
    for batch in (16, 64):
        lg = build_layers(build_planning_graph(wide_mlp(width, 3, batch), cpu(2)))
        w, bias = width * width * 4, width * 4
        assert [L.fixed_bytes for L in lg.layers] == [(w + bias, 0, w + bias)] + [(w + bias, w, w + bias)] * 2


def test_a_stage_pays_its_weight_traffic_per_microbatch():
    """The stage estimate carries the layers' traffic at the device's memory bandwidth; with more microbatches its
    step's compute grows by that traffic, so a weight-heavy stage is not predicted faster for more microbatches."""
    cl = FixedCluster.uniform([("h0", 2)], memory_bandwidth_bytes_per_s=1e10)
    pg = build_planning_graph(wide_mlp(2048, 4, 16), cl)
    lg = build_layers(pg)
    e = StageCoster(lg, cl, "sgd", "analytic")(0, 2, (0,))
    fixed = [sum(L.fixed_bytes[k] for L in lg.layers[:2]) for k in range(3)]
    assert e.fixed_s == pytest.approx(tuple(b / 1e10 for b in fixed))
    assert e.grad_add_s == pytest.approx(sum(L.trainable_bytes for L in lg.layers[:2]) / 1e10)
    step = {m: m * sum(e.per_microbatch(m)) for m in (2, 4, 8)}
    assert step[4] - step[2] == pytest.approx(2 * (sum(e.fixed_s) + 3 * e.grad_add_s) + 2 * 2.5e-4 + e.overhead_s * 2,
                                              rel=1e-6)
    assert step[2] < step[4] < step[8]
