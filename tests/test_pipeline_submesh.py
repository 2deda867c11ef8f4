"""Pipeline stages on sub-meshes of different sizes (``--stage-ranks 2,1``): the activations and their gradients
resharded at each stage boundary (batch rows cut and concatenated, replicated values copied, partial gradients
summed; adaptdist/stage_routes.py). One-process simulation (simulate_pipeline) and the gloo executor equal eager:
loss, every gradient and the SGD-updated parameters, to 1e-5."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions
from adaptdist.errors import PipelineError, UsageError
from adaptdist.pipeline_schedules import Action, pipeline_order
from adaptdist.stage_routes import COPY, SPLIT, SUM, StageRoutes, assemble, boundary_routes, cut, piece_shape
from test_pipeline_lowering import check_against_eager, deep_mlp, eager, tiny_gpt


# --- the routes alone ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_a,dp_b", [(2, 1), (1, 2), (3, 1), (1, 3), (3, 2), (2, 3)])
def test_routes_cut_and_put_together_the_rows(dp_a, dp_b):
    """A [6, 4, 5] microbatch, batch dim 1 (not 0: the placements say which), split over dp_a senders: each of the
    dp_b receivers assembles exactly its rows; a replicated value is copied; partial gradients sum to the total."""
    full = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    rep = torch.randn(3)
    mine_a = [full[:, 6 // dp_a * a: 6 // dp_a * (a + 1)] for a in range(dp_a)]
    senders, receivers = [10 + a for a in range(dp_a)], [20 + b for b in range(dp_b)]
    send, recv = boundary_routes("forward", ["x", "w"], [mine_a[0].shape, rep.shape],
                                 [(4, 6 // dp_b, 5), rep.shape], senders, receivers, "test")
    for b in range(dp_b):
        got = []
        for i, spec_shape in enumerate([(4, 6 // dp_b, 5), rep.shape]):
            parts = []
            for p in recv[b][i].pieces:
                a = senders.index(p.peer)
                (x,) = [t for peer, t in cut([mine_a[a], rep][i], send[a][i]) if peer == receivers[b]]
                assert tuple(x.shape) == piece_shape(spec_shape, p)
                parts.append(x)
            got.append(assemble(parts, recv[b][i], spec_shape, torch.float32))
        assert torch.equal(got[0], full[:, 6 // dp_b * b: 6 // dp_b * (b + 1)])
        assert torch.equal(got[1], rep) and recv[b][1].combine == COPY and recv[b][0].combine == SPLIT
    # backward: partial gradients of the replicated value from dp_b senders to dp_a receivers sum to the total
    partial = [torch.randn(3) for _ in range(dp_b)]
    gs, gr = boundary_routes("backward", ["g"], [(3,)], [(3,)], receivers, senders, "test")
    total = torch.zeros(3)
    for a in range(dp_a):
        parts = [[t for peer, t in cut(partial[receivers.index(p.peer)], gs[receivers.index(p.peer)][0])
                  if peer == senders[a]][0] for p in gr[a][0].pieces]
        assert gr[a][0].combine == SUM
        total += assemble(parts, gr[a][0], (3,), torch.float32)
    torch.testing.assert_close(total, sum(partial))
    # JSON form
    r = StageRoutes(send=tuple(send[0]), recv=(), grad_in=tuple(gr[0]), grad_out=())
    assert StageRoutes.from_doc(json.loads(json.dumps(r.to_doc()))) == r


def test_a_value_that_is_no_batch_split_is_refused_naming_it():
    with pytest.raises(PipelineError, match=r"forward value 'h' is \[4, 3\] on each of the sending stage's 2 .*"
                                            r"\[4, 5\] on each of the receiving stage's 1"):
        boundary_routes("forward", ["h"], [(4, 3)], [(4, 5)], [0, 1], [2], "boundary")


# --- deadlock freedom with several peers per exchange ------------------------------------------------------------

def _expand(order: dict[int, list[Action]], sizes: list[int]) -> dict[int, list[tuple]]:
    """Each stage-level send/receive of the schedule as the messages of the replica groups (as the executor posts
    them: per tensor, then peer; one tensor here), on ranks laid out stage by stage."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    ranks = [list(range(starts[s], starts[s] + sizes[s])) for s in range(len(sizes))]
    out: dict[int, list[tuple]] = {}
    for s, acts in order.items():
        for a_idx, r in enumerate(ranks[s]):
            lst = []
            for a in acts:
                if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    peer_stage = a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)
                    tag = (min(a.stage, peer_stage), a.kind.endswith("B"), a.microbatch)
                    peers = ranks[peer_stage]  # every pair exchanges (the densest routes)
                    for p in peers:
                        lst.append(("send" if a.kind.startswith("SEND") else "recv", p, tag))
            out[r] = lst
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("sizes", [[2, 1], [1, 3], [3, 1], [2, 1, 2]])
def test_routed_exchanges_terminate_with_rendezvous_sends(schedule, sizes):
    """Blocking sends and receives (both ends must be there), every sender posting to every receiver of the next
    stage in rank order: every rank's list finishes (the module docstring's argument, checked)."""
    M = 4
    lists = _expand(pipeline_order(schedule, len(sizes), M, 1), sizes)
    pos = {r: 0 for r in lists}
    moved = True
    while moved:
        moved = False
        for r in lists:
            if pos[r] >= len(lists[r]):
                continue
            kind, peer, tag = lists[r][pos[r]]
            if pos[peer] < len(lists[peer]):
                k2, p2, t2 = lists[peer][pos[peer]]
                if p2 == r and t2 == tag and {kind, k2} == {"send", "recv"}:
                    pos[r] += 1
                    pos[peer] += 1
                    moved = True
    stuck = {r: lists[r][pos[r]] for r in lists if pos[r] < len(lists[r])}
    assert not stuck, stuck


# --- lowered programs, simulated -----------------------------------------------------------------------------------

# the simulation runs GPipe's order whatever the schedule (the gloo test below runs the schedules' own orders)
CASES = [("gpt", (2, 1), "1f1b", 2), ("mlp", (1, 3), "gpipe", 2), ("mlp", (3, 1), "1f1b", 4),
         ("mlp", (2, 1), "gpipe", 2)]


@pytest.mark.parametrize("model,sizes,schedule,microbatches", CASES)
def test_stages_of_different_sizes_equal_eager(model, sizes, schedule, microbatches):
    m, batch, loss_fn = tiny_gpt(batch_size=12) if model == "gpt" else deep_mlp(batch_size=12)
    expected = eager(m, batch, loss_fn)
    world = sum(sizes)
    progs = compile_model(m, batch, loss_fn, world, None, pipeline=PipelineOptions(
        microbatches=microbatches, schedule=schedule, stage_ranks=sizes))
    assert sorted(progs) == list(range(world))
    assert [len(progs[0].stage_ranks[s]) for s in range(len(sizes))] == list(sizes)
    assert progs[0].plan.world_size == world and progs[0].plan.mesh == {"pp": len(sizes), "dp": max(sizes)}
    for p in progs.values():
        st = p.stages[0]
        assert st.routes is not None and p.microbatch_stride == 12 // microbatches
        # each rank's pieces of each boundary tensor: as many as the overlapping replicas on the other side
        if not st.is_last:
            assert all(len(r.pieces) >= 1 for r in st.routes.send)
    check_against_eager(progs, batch, expected)
    if model == "mlp" and sizes == (2, 1):  # a format that drops the routes: refused, not wrong numbers
        from adaptdist.runtime.simulate_pipeline import simulate_pipeline

        bare = {r: dataclasses.replace(p, stages=tuple(dataclasses.replace(st, routes=None) for st in p.stages))
                for r, p in progs.items()}
        with pytest.raises(PipelineError, match=r"stage 0 \(2 rank\(s\)\) borders stage 1 \(1\) but its program "
                                                r"has no routes"):
            simulate_pipeline(bare, batch)


def test_stage_ranks_are_checked():
    m, batch, loss_fn = deep_mlp(batch_size=12)
    with pytest.raises(UsageError, match=r"--stage-ranks 2,2 adds up to 4 ranks, this job has 3"):
        compile_model(m, batch, loss_fn, 3, None, pipeline=PipelineOptions(microbatches=2, stage_ranks=(2, 2)))
    with pytest.raises(PipelineError, match=r"does not split evenly over 5 data-parallel replicas|5 replica"):
        compile_model(m, batch, loss_fn, 6, None, pipeline=PipelineOptions(microbatches=2, stage_ranks=(5, 1)))


def test_the_planner_chooses_layer_ranges_for_given_stage_sizes_and_lowers_them():
    """plan_pipeline(stage_sizes=(2, 1)): the inter-stage DP on fixed data-parallel sub-meshes of different sizes;
    pipeline_plan lowers its choice; equal eager."""
    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner.stages import pipeline_plan, plan_pipeline

    m, batch, loss_fn = deep_mlp(batch_size=12)
    expected = eager(m, batch, loss_fn)
    cg = capture(m, batch, loss_fn)
    choice = plan_pipeline(cg, local_cluster(3), stage_sizes=(2, 1), microbatches=[2],
                           schedules=("1f1b",))
    assert [list(s.ranks) for s in choice.stages] == [[0, 1], [2]]
    plan = pipeline_plan(cg, choice, 3)
    assert [dict(s.mesh) for s in plan.pipeline.stages] == [{"dp": 2}, {}]
    assert [s.layers for s in plan.pipeline.stages] == [tuple(s.layers) for s in choice.stages]
    progs = compile_model(m, batch, loss_fn, 3, plan, captured=cg)
    check_against_eager(progs, batch, expected)


def test_the_planners_pp_x_tp_places_parameters_as_the_stage_ilp_chose():
    """A model without TP_PLAN on pp=2 x tp=2: pipeline_plan takes each stage ILP's parameter placements (here
    the wide layers sharded over tp), and the lowered pipeline equals eager."""
    import torch.nn.functional as F

    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner.stages import pipeline_plan, plan_pipeline
    from adaptdist.mesh import Mesh
    from adaptdist.placement import Shard
    from test_pipeline_lowering import DeepMLP

    torch.manual_seed(0)
    m = DeepMLP(widths=(16, 2048, 2048, 2048, 5))
    batch = (torch.randn(8, 16), torch.randint(0, 5, (8,)))

    def loss_fn(o, t):
        return F.cross_entropy(o, t)
    expected = eager(m, batch, loss_fn)
    cg = capture(m, batch, loss_fn)
    choice = plan_pipeline(cg, local_cluster(4), uniform=True, submesh=Mesh.parse("tp=2"), microbatches=[2],
                           schedules=("1f1b",))
    ilp = {f: p for st in choice.stages for f, p in st.param_placements}
    assert any(isinstance(x, Shard) for p in ilp.values() for x in p), ilp  # the ILP shards the wide layers
    plan = pipeline_plan(cg, choice, 4)
    assert plan.mesh == {"pp": 2, "tp": 2} and plan.name == "pp+auto"
    assert {f: p[1:] for f, p in plan.param_placements.items()} == ilp
    progs = compile_model(m, batch, loss_fn, 4, plan, captured=cg)
    check_against_eager(progs, batch, expected)


# --- gloo: the executor's routed sends and receives, and `adaptdist train --stage-ranks` ---------------------------

@pytest.mark.slow
def test_stages_of_different_sizes_on_gloo_equal_eager(tmp_path):
    """3 gloo ranks, {2,1} under gpipe and 1f1b and {1,2} under zb, two SGD steps: every rank's loss, gradients and
    parameters equal eager's."""
    from adaptdist.runtime.launch import launch_local
    from adaptdist.stage_program_io import save_pipeline_programs
    from models import tiny_gpt as gpt_of
    from pipeline_workers import lowered_pipeline_worker
    from reference import eager_sgd

    B, LR, TOL = 12, 0.5, 1e-5
    model, batch, loss_fn = gpt_of(B)
    batches = [gpt_of(B, seed=10 + s)[1] for s in range(2)]
    cases = [((2, 1), "gpipe", 2), ((2, 1), "1f1b", 2), ((1, 2), "zb", 3)]
    dirs, compiled = [], {}
    for i, (sizes, schedule, m) in enumerate(cases):
        if (sizes, m) not in compiled:  # the stage programs do not depend on the schedule, only its field does
            compiled[(sizes, m)] = compile_model(model, batch, loss_fn, 3, None, pipeline=PipelineOptions(
                microbatches=m, schedule=schedule, stage_ranks=sizes))
        programs = {r: dataclasses.replace(p, schedule=schedule) for r, p in compiled[(sizes, m)].items()}
        dirs.append(str(save_pipeline_programs(programs, tmp_path / f"case{i}")))
    results = launch_local(lowered_pipeline_worker, (dirs, batches, LR, 2), 3)
    history, final = eager_sgd(model, batches, loss_fn, LR, 2)
    for i, case in enumerate(cases):
        for r in range(3):
            res = results[r][i]
            for s, (loss, grads) in enumerate(history):
                assert res["losses"][s] == pytest.approx(loss, abs=TOL), (case, r, s)
                for f, g in res["grads"][s].items():
                    torch.testing.assert_close(g, grads[f], atol=TOL, rtol=TOL, msg=f"{case} rank {r} step {s} {f}")
            for f, p in res["params"].items():
                torch.testing.assert_close(p, final[f], atol=TOL, rtol=TOL, msg=f"{case} rank {r} param {f}")


@pytest.mark.slow
def test_train_stage_ranks_on_three_ranks_equals_eager(tmp_path):
    """`adaptdist train --plan pp --stage-ranks 2,1 --nproc 3`: summary.json's losses are eager's; plan.json keeps
    the stages' sub-meshes."""
    from adaptdist.cli.main import main
    from test_pipeline_cli import MODEL, TRAIN, _eager_losses, _losses

    out = tmp_path / "run"
    assert main(["train", MODEL, *TRAIN, "--plan", "pp", "--stage-ranks", "2,1", "--nproc", "3", "--schedule", "1f1b",
                 "--microbatches", "2", "--steps", "2", "--out", str(out)]) == 0
    assert _losses(out) == pytest.approx(_eager_losses(2), abs=1e-5)
    plan = json.loads((out / "programs" / "plan.json").read_text())
    assert [dict(s["mesh"]) for s in plan["pipeline"]["stages"]] == [{"dp": 2}, {}]


@pytest.mark.slow
def test_compile_stage_ranks_then_run_equals_eager(tmp_path):
    """`adaptdist compile --plan pp --stage-ranks 2,1 --nproc 3` + `adaptdist run`: the directory loads (each stage's
    ranks read the batch once; it was refused as overlapping rows) and summary.json's losses are eager's."""
    from adaptdist.cli.main import main
    from test_pipeline_cli import COMMON, LR, MODEL, _eager_losses, _losses

    art, out = tmp_path / "art", tmp_path / "run"
    assert main(["compile", MODEL, *COMMON, "--plan", "pp", "--stage-ranks", "2,1", "--nproc", "3", "--microbatches",
                 "2", "-o", str(art)]) == 0
    assert main(["run", str(art), "--optimizer", "sgd", "--lr", str(LR), "--out", str(out), "--steps", "2"]) == 0
    assert _losses(out) == pytest.approx(_eager_losses(2), abs=1e-5)


def test_the_planner_gives_a_faster_device_a_stage_of_its_own():
    """3 ranks, ranks 0 and 1 half as fast as rank 2: without --mesh the planner weighs stages of different sizes
    and puts the two slow ranks on one data-parallel stage and the fast one alone, with as many layers: predicted
    faster than every equal split into 1-rank stages."""
    import itertools

    import torch.nn as nn
    import torch.nn.functional as F

    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.pipeline_auto import choose_pipeline_plan
    from adaptdist.compiler.planner.stages import plan_pipeline
    from adaptdist.cost_models.hardware import FixedCluster

    torch.manual_seed(0)
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(512, 512), nn.ReLU()) for _ in range(6)))
    x = torch.randn(512, 512)  # compute well above the stage's gradient all-reduce
    cg = capture(model, (x, x), F.mse_loss)
    cl = FixedCluster.uniform([("h0", 3)], op_overhead_s=5e-6)
    def slow(d):
        return dataclasses.replace(d, peak_flops={k: v / 2 for k, v in d.peak_flops.items()},
                                   memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s / 2)
    hetero = dataclasses.replace(cl, devices=(slow(cl.devices[0]), slow(cl.devices[1]), cl.devices[2]))
    d = choose_pipeline_plan(cg, hetero, 3, schedule="1f1b", microbatches=8)
    stages = d.plan.pipeline.stages
    assert [list(s.ranks) for s in stages] == [[0, 1], [2]], [s.ranks for s in stages]
    assert [dict(s.mesh) for s in stages] == [{"dp": 2}, {}] and d.plan.world_size == 3
    even = plan_pipeline(cg, hetero, uniform=True, microbatches=[8], schedules=("1f1b",), coster="analytic")
    assert d.choice.step_s < even.step_s and len(even.stages) == 3
    assert "mesh dp=2" in "\n".join(d.lines())


def test_a_pipeline_manifest_may_hold_the_largest_stage_mesh():
    """A compile of stages of different sizes records mesh pp=2,dp=2 (the largest sub-mesh) for 3 ranks: accepted
    for a pipeline manifest, still refused for an SPMD one and where the mesh is smaller than the world."""
    from pathlib import Path

    from adaptdist.artifact_checks import check_manifest
    from adaptdist.errors import ProgramLoadError

    base = {"format_version": 1, "torch_version": torch.__version__, "world_size": 3, "files": {},
            "mesh": {"pp": 2, "dp": 2}}
    check_manifest({**base, "pipeline": True}, Path("m.json"))
    with pytest.raises(ProgramLoadError, match=r"multiply to 4, not the world size 3"):
        check_manifest(base, Path("m.json"))
    with pytest.raises(ProgramLoadError, match=r"multiply to 2, not the world size 3"):
        check_manifest({**base, "pipeline": True, "mesh": {"pp": 2}}, Path("m.json"))


def test_a_resumed_run_scales_its_stage_ranks(tmp_path):
    from types import SimpleNamespace

    from adaptdist.cli.train import _restored_args, _stage_ranks_for

    (tmp_path / "run.json").write_text(json.dumps({"settings": {"stage_ranks": [2, 1], "nproc": 3}}))
    args = SimpleNamespace(resume=str(tmp_path), stage_ranks=(2, 1), steps=5, nproc=None, cluster=None)
    _restored_args(args, {"stage_ranks": None, "steps": 10}, keys=("stage_ranks",))  # the same value: accepted
    assert args.stage_ranks == (2, 1) and args.nproc == 3

    assert _stage_ranks_for((2, 1), 3) == (2, 1) and _stage_ranks_for((2, 1), 6) == (4, 2)
    assert _stage_ranks_for((2, 1), 2) == (1, 1) and _stage_ranks_for((3, 1), 5) is None
