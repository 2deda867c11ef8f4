"""The late pass that puts shared-memory axes' collectives on adaptdist's kernels, and the choice of axes
(``--comm auto|shm|gloo``): one process, no collectives run."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import adaptdist.kernels as kernels
from adaptdist.comm_transport import axis_transports, is_shm_collective, shm_groups_in_code, transports_of_code
from adaptdist.errors import ShmUnavailableError, UsageError
from adaptdist.lowering_options import LoweringOptions
from adaptdist.mesh import Mesh
from adaptdist.passes.use_shm_collectives import use_shm_collectives

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"shm kernels not built: {kernels.load_error()}")
c10d = torch.ops._c10d_functional


def _graph(calls):
    """A graph of one input per call: ``call(input node) -> collective node``; each collective is waited on and
    the waits returned."""
    g = torch.fx.Graph()
    outs = []
    for i, (shape, dtype, make) in enumerate(calls):
        x = g.placeholder(f"x{i}")
        x.meta["val"] = torch.empty(shape, dtype=dtype)
        c = make(g, x)
        c.meta["val"] = torch.empty(shape, dtype=dtype)
        w = g.call_function(c10d.wait_tensor.default, (c,))
        w.meta["val"] = c.meta["val"]
        outs.append(w)
    g.output(tuple(outs))
    return torch.fx.GraphModule(nn.Module(), g)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@needs_kernels
def test_swaps_supported_collectives_of_shm_groups_and_drops_their_waits():
    ar = lambda grp, op="sum": lambda g, x: g.call_function(c10d.all_reduce.default, (x, op, grp))  # noqa: E731
    gm = _graph([
        ((8,), torch.float32, ar("adaptdist:dp")),
        ((8,), torch.float32, ar("adaptdist:tp")),  # another group: stays
        ((8,), torch.float32, ar("adaptdist:dp", "min")),  # no min kernel: stays
        ((8,), torch.int64, ar("adaptdist:dp")),  # integers are not reduced by the kernels: stays
        ((4, 3), torch.float32, lambda g, x: g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "adaptdist:dp"))),
        ((4, 3), torch.bfloat16,
         lambda g, x: g.call_function(c10d.reduce_scatter_tensor.default, (x, "avg", 2, "adaptdist:dp"))),
        ((4, 3), torch.float32,
         lambda g, x: g.call_function(c10d.all_to_all_single.default, (x, [2, 2], [2, 2], "adaptdist:dp"))),
        ((4, 3), torch.float32,  # uneven splits: stays on gloo
         lambda g, x: g.call_function(c10d.all_to_all_single.default, (x, [1, 3], [3, 1], "adaptdist:dp"))),
    ])
    gm, changed = use_shm_collectives(gm, {"adaptdist:dp"})
    assert changed
    shm = torch.ops.adaptdist
    assert _targets(gm) == [
        shm.shm_all_reduce.default,
        c10d.all_reduce.default, c10d.wait_tensor.default,
        c10d.all_reduce.default, c10d.wait_tensor.default,
        c10d.all_reduce.default, c10d.wait_tensor.default,
        shm.shm_all_gather_into_tensor.default,
        shm.shm_reduce_scatter_tensor.default,
        shm.shm_all_to_all_single.default,
        c10d.all_to_all_single.default, c10d.wait_tensor.default,
    ]
    first = next(n for n in gm.graph.nodes if n.target == shm.shm_all_reduce.default)
    assert first.args[1:] == ("sum", "adaptdist:dp") and first.meta["val"].shape == (8,)
    assert list(gm.graph.output_node().args[0])[0] is first  # the wait's users now read the shm op
    assert all(is_shm_collective(t) for t in _targets(gm) if str(t).startswith("adaptdist."))
    assert shm_groups_in_code(gm.code.replace('"', "'")) == ["adaptdist:dp"]


def test_no_shm_group_leaves_the_graph_untouched():
    gm = _graph([((8,), torch.float32, lambda g, x: g.call_function(c10d.all_reduce.default, (x, "sum", "adaptdist:dp")))])
    before = gm.code
    assert use_shm_collectives(gm, set()) == (gm, False)
    assert use_shm_collectives(gm, {"adaptdist:tp"})[1] is False
    assert gm.code == before


def test_axis_transports_by_mode_and_hosts(monkeypatch):
    mesh = Mesh.parse("dp=2,tp=2")  # tp groups (0,1), (2,3); dp groups (0,2), (1,3)
    two_hosts = ("a", "a", "b", "b")
    assert axis_transports(mesh, "auto", two_hosts, kernels_available=True) == {"dp": "gloo", "tp": "shm"}
    assert axis_transports(mesh, "auto", ("a",) * 4, kernels_available=True) == {"dp": "shm", "tp": "shm"}
    assert axis_transports(mesh, "auto", two_hosts, kernels_available=False) == {"dp": "gloo", "tp": "gloo"}
    assert axis_transports(mesh, "auto", None, kernels_available=True) == {"dp": "gloo", "tp": "gloo"}  # hosts unknown
    assert axis_transports(mesh, "gloo", ("a",) * 4, kernels_available=True) == {"dp": "gloo", "tp": "gloo"}
    assert axis_transports(Mesh.parse("dp=1,tp=2"), "gloo", None)["dp"] == "none"
    with pytest.raises(UsageError, match="3 host names"):
        axis_transports(mesh, "auto", ("a",) * 3, kernels_available=True)
    with pytest.raises(UsageError, match="comm must be one of"):
        axis_transports(mesh, "nccl", None)
    monkeypatch.setattr(kernels, "load", lambda: kernels.LoadResult(None, "disabled by ADAPTDIST_KERNELS=0"))
    with pytest.raises(ShmUnavailableError, match="--comm shm.*disabled by ADAPTDIST_KERNELS=0"):
        axis_transports(mesh, "shm", two_hosts)


def test_lowering_options_check_comm():
    with pytest.raises(UsageError, match="comm must be one of"):
        LoweringOptions(comm="mpi")
    with pytest.raises(UsageError, match="hosts must be a tuple"):
        LoweringOptions(hosts=["a", "a"])


def _compile(options, nproc=2):
    from adaptdist.compiler.lowering import compile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    return compile_model(model, batch, F.cross_entropy, nproc, None, options)


@needs_kernels
def test_lowering_puts_one_host_axes_on_shm_only():
    shm = _compile(LoweringOptions(comm="auto", hosts=("h", "h")))
    gloo = _compile(LoweringOptions(comm="gloo", hosts=("h", "h")))
    apart = _compile(LoweringOptions(comm="shm", hosts=("h1", "h2")))  # dp crosses hosts: gloo even under shm
    for r in (0, 1):
        assert transports_of_code(shm[r].code, shm[r].group_names, shm[r].mesh) == {"dp": "shm"}
        assert transports_of_code(gloo[r].code, gloo[r].group_names, gloo[r].mesh) == {"dp": "gloo"}
        assert apart[r].code == gloo[r].code
        # the same collectives, in the same order and sizes, carried by other ops
        strip = lambda calls: [c.split("(")[1].replace("adaptdist:dp[0,1]", "adaptdist:dp") for c in calls]  # noqa: E731
        assert strip(shm[r].collectives()) == strip(gloo[r].collectives()) and shm[r].collectives()
        assert shm_groups_in_code(shm[r].code) == ["adaptdist:dp[0,1]"]  # named by the group's ranks
        assert all(c.startswith("adaptdist.shm_") for c in shm[r].collectives())
        assert "wait_tensor" not in shm[r].code and "wait_tensor" in gloo[r].code
    assert _compile(LoweringOptions())[0].code == gloo[0].code  # no hosts: auto keeps gloo


def test_shm_group_names_tell_rank_sets_apart():
    """Two rank sets never share a name (graphs on different meshes in one process each get their own shm group);
    the axis's group name is recovered from any of them."""
    from adaptdist.mesh import base_group_name, shm_group_name

    names = {shm_group_name("adaptdist:dp", g) for g in [(0, 1), (1, 0), (0, 2), (0, 1, 2, 3), (0, 2, 4, 6),
                                                          tuple(range(16)), tuple(range(0, 32, 2)), tuple(range(1, 17))]}
    assert len(names) == 8
    assert shm_group_name("adaptdist:dp", (0, 2)) == "adaptdist:dp[0,2]"
    assert shm_group_name("adaptdist:tp", range(1, 64, 2)) == "adaptdist:tp[1:64:2]"
    assert shm_group_name("adaptdist:tp", range(64)) == "adaptdist:tp[0:64]"
    assert all(base_group_name(n) == "adaptdist:dp" for n in names) and base_group_name("adaptdist:dp") == "adaptdist:dp"


@needs_kernels
def test_each_rank_names_its_own_groups_and_the_cost_model_reads_their_axes():
    """dp=2,tp=2 on one host: rank r's shm ops name its own dp and tp groups' ranks; the consistency calls, the
    transports and the cost model see the axes' groups."""
    from adaptdist.compiler.consistency import collective_calls
    from adaptdist.cost_models.communication import group_members
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.annotations import ManualPlan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    plan = ManualPlan(name="dp,tp", mesh_axes=("dp", "tp"), batch_axis="dp",
                      params=(("0.weight", ("R", "S(0)")), ("0.bias", ("R", "S(0)")), ("2.weight", ("R", "S(1)"))))
    progs = compile_model(model, (torch.randn(8, 8), torch.randint(0, 4, (8,))), F.cross_entropy, 4, plan,
                          LoweringOptions(comm="auto", hosts=("h",) * 4), mesh="dp=2,tp=2")
    mesh = Mesh.parse("dp=2,tp=2")
    for r, p in progs.items():
        want = {f"adaptdist:{a}[{','.join(map(str, mesh.group(a, r)))}]" for a in ("dp", "tp")}
        assert set(shm_groups_in_code(p.code)) == want, (r, shm_groups_in_code(p.code))
        assert transports_of_code(p.code, p.group_names, p.mesh) == {"dp": "shm", "tp": "shm"}
        assert {c.group for c in collective_calls(p)} == {"adaptdist:dp", "adaptdist:tp"}
        for name in want:
            axis = name.split(":")[1].split("[")[0]
            assert group_members(name, r, p.mesh) == mesh.group(axis, r)


@needs_kernels
def test_pipeline_groups_of_one_host_take_shared_memory():
    """Pipelines (``--comm auto``), pp=2 x tp=2 with each stage on a host of its own: a rank's groups whose ranks
    share a host are its ``shm_groups`` (the intra-stage tp group: its stage programs' collectives become shm ops
    naming it, in each rank's own copy of the stage modules); the tied embedding's holders (stage 0 and 1: across
    hosts) and ``pp`` (sends and receives) stay on gloo. The runtime's data-parallel all-reduces on shm:
    tests/test_pipeline_cli.py::test_train_pp_dp_on_shared_memory_equals_eager (4 ranks)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import adaptdist.models.gpt as gpt_module
    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(8)
    tp = compile_model(model, batch, loss_fn, 4, ManualPlan.parse("tp", gpt_module),
                       LoweringOptions(comm="auto", hosts=("a", "a", "b", "b")), mesh="pp=2,tp=2",
                       pipeline=PipelineOptions(microbatches=2, schedule="1f1b"))
    for r, p in tp.items():
        mine = (0, 1) if r < 2 else (2, 3)  # ranks 0,1 run stage 0 (host a), ranks 2,3 stage 1 (host b)
        name = f"adaptdist:tp[{mine[0]},{mine[1]}]"
        assert p.shm_groups == {name: mine}, (r, p.shm_groups)
        assert p.transports() == {"pp": "gloo", "tp": "shm"}
        code = "".join(m.code for st in p.stages for m in (st.forward, st.backward_input, st.backward_weight))
        assert set(shm_groups_in_code(code.replace('"', "'"))) == {name} and "_c10d_functional" not in code, r


@needs_kernels
def test_collectives_with_work_before_their_wait_are_started_and_waited_for():
    """A collective whose wait does not follow it at once (a gradient bucket issued before the rest of backward)
    becomes ``shm_X_start`` + ``shm_wait`` at the wait's place; the others stay complete on return. The cost
    model, the consistency checks and the trace see the started op as the collective and ``shm_wait`` as its wait;
    the graph computes what the functional one did (one rank)."""
    from adaptdist.comm_transport import is_shm_started, is_shm_wait
    from adaptdist.cost_models.communication import functional_collective_kind, is_synchronous_collective

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 3)
    started = {}
    for name, op, args in (("ar", c10d.all_reduce.default, ("sum", "adaptdist:dp")),
                           ("ag", c10d.all_gather_into_tensor.default, (1, "adaptdist:dp")),
                           ("rs", c10d.reduce_scatter_tensor.default, ("sum", 1, "adaptdist:dp"))):
        c = g.call_function(op, (x, *args))
        c.meta["val"] = torch.empty(4, 3)
        started[name] = c
    work = g.call_function(torch.ops.aten.mul.Tensor, (x, x))  # between the issues and the waits
    work.meta["val"] = torch.empty(4, 3)
    outs = [work]
    for c in started.values():
        w = g.call_function(c10d.wait_tensor.default, (c,))
        w.meta["val"] = c.meta["val"]
        outs.append(w)
    now = g.call_function(c10d.all_reduce.default, (work, "max", "adaptdist:dp"))  # waited at once: stays whole
    now.meta["val"] = torch.empty(4, 3)
    w = g.call_function(c10d.wait_tensor.default, (now,))
    w.meta["val"] = now.meta["val"]
    g.output((*outs, w))
    gm, changed = use_shm_collectives(torch.fx.GraphModule(nn.Module(), g), {"adaptdist:dp": "st"})
    shm = torch.ops.adaptdist
    assert changed and _targets(gm) == [
        shm.shm_all_reduce_start.default, shm.shm_all_gather_into_tensor_start.default,
        shm.shm_reduce_scatter_tensor_start.default, torch.ops.aten.mul.Tensor,
        shm.shm_wait.default, shm.shm_wait.default, shm.shm_wait.default, shm.shm_all_reduce.default]
    kinds = [functional_collective_kind(t) for t in _targets(gm)]
    assert kinds == ["all_reduce", "all_gather", "reduce_scatter", None, "wait", "wait", "wait", "all_reduce"]
    assert [is_shm_started(t) for t in _targets(gm)][:3] == [True] * 3 and is_shm_wait(shm.shm_wait.default)
    assert not is_synchronous_collective(shm.shm_all_reduce_start.default)
    assert is_synchronous_collective(shm.shm_all_reduce.default) and not is_shm_collective(shm.shm_wait.default)
    assert shm_groups_in_code(gm.code.replace('"', "'")) == ["st"]

    import torch.distributed as dist

    from adaptdist.kernels import shm as kshm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kshm.init_group(name="st", comm_thread=True, timeout_s=10.0, job_key="test_started")
        t = torch.randn(4, 3)
        got = gm(t)
        assert all(torch.equal(a, b) for a, b in zip(got, (t * t, t, t, t, t * t)))
        kshm.destroy_group("st")
    finally:
        dist.destroy_process_group()


@needs_kernels
def test_gradient_buckets_are_flattened_into_the_registered_input_region():
    """A started all_reduce of a bucket of 256 KiB or more (``cat`` of 1-d tensors used by nothing else) becomes
    ``shm_flatten_all_reduce_start`` at its own 64-byte-aligned offset of the group's region; a cat with another
    user, a smaller bucket and the all_reduce of a tensor without a cat stay; the cost model, the consistency checks
    and the trace count it as the all_reduce of the bucket's bytes; the graph computes what cat + all_reduce did
    (one rank)."""
    from adaptdist.comm_transport import is_shm_started
    from adaptdist.cost_models.communication import functional_collective_kind

    aten = torch.ops.aten
    g = torch.fx.Graph()
    xs = []
    sizes = (40000, 30000, 70000, 4, 6)  # buckets of 280,000, 280,000 and 40 bytes
    for i, n in enumerate(sizes):
        x = g.placeholder(f"x{i}")
        x.meta["val"] = torch.empty(n)
        xs.append(x)
    whole = g.placeholder("x5")  # one 2-d tensor of 280,000 bytes, no cat: stays (copy-in of the peers' slices only)
    whole.meta["val"] = torch.empty(100, 700)
    starts, outs = [], []
    for parts in ((xs[0], xs[1]), (xs[2],), (xs[3], xs[4]), (xs[3],)):
        cat = g.call_function(aten.cat.default, (list(parts),))
        cat.meta["val"] = torch.empty(sum(p.meta["val"].numel() for p in parts))
        c = g.call_function(c10d.all_reduce.default, (cat, "sum", "adaptdist:dp"))
        c.meta["val"] = cat.meta["val"]
        starts.append(c)
        if parts == (xs[3], xs[4]):
            outs.append(cat)  # this cat has another user: it stays
    c = g.call_function(c10d.all_reduce.default, (whole, "sum", "adaptdist:dp"))
    c.meta["val"] = whole.meta["val"]
    starts.append(c)
    work = g.call_function(aten.mul.Tensor, (xs[0], xs[0]))  # between the issues and the waits
    work.meta["val"] = torch.empty(sizes[0])
    outs.append(work)
    for c in starts:
        w = g.call_function(c10d.wait_tensor.default, (c,))
        w.meta["val"] = c.meta["val"]
        outs.append(w)
    g.output(tuple(outs))
    gm, changed = use_shm_collectives(torch.fx.GraphModule(nn.Module(), g), {"adaptdist:dp": "fl"})
    shm = torch.ops.adaptdist
    fused = [n for n in gm.graph.nodes if n.target is shm.shm_flatten_all_reduce_start.default]
    assert changed and len(fused) == 2
    assert [n.args[1:] for n in fused] == [(0, "sum", "fl"), (280000, "sum", "fl")]  # 280,000 = 64 * 4375
    assert [a.name for a in fused[0].args[0]] == ["x0", "x1"] and [a.name for a in fused[1].args[0]] == ["x2"]
    # the 40-byte bucket (its output private) and the one-part bucket under 256 KiB keep cat + all_reduce
    assert sum(n.target is aten.cat.default for n in gm.graph.nodes) == 2
    assert sum(n.target is shm.shm_all_reduce_start.default for n in gm.graph.nodes) == 3
    assert is_shm_started(fused[0].target) and is_shm_collective(fused[0].target)
    assert functional_collective_kind(fused[0].target) == "all_reduce"

    import torch.distributed as dist

    from adaptdist.kernels import shm as kshm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kshm.init_group(name="fl", comm_thread=True, timeout_s=10.0, job_key="test_flatten")
        ts = [torch.randn(n) for n in sizes] + [torch.randn(100, 700)]
        got = gm(*ts)
        want = (torch.cat(ts[3:5]), ts[0] * ts[0], torch.cat(ts[:2]), ts[2], torch.cat(ts[3:5]), ts[3], ts[5])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        kshm.destroy_group("fl")
    finally:
        dist.destroy_process_group()


@needs_kernels
def test_axes_put_back_on_gloo_at_the_start_carry_the_gloo_lowerings_collectives(tmp_path):
    """--comm auto, an axis whose shared-memory group cannot be made as the run starts: use_gloo_for_axes rewrites
    the program so that axis's collectives are the ones `--comm gloo` lowers (same ops, order, groups and sizes; a
    fused bucket flatten becomes cat + all_reduce + wait), the other axes' stay on shared memory; for a lowered
    program (a GraphModule: the torch.compile backend's) and a loaded one (exec'd source: run, train)."""
    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import load_program, save_programs
    from adaptdist.runtime.shm_groups import ShmShortfall, use_gloo_for_axes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 4))
    plan = ManualPlan(name="dp,tp", mesh_axes=("dp", "tp"), batch_axis="dp",
                      params=(("0.weight", ("R", "S(0)")), ("0.bias", ("R", "S(0)")), ("2.weight", ("R", "S(1)"))))
    batch = (torch.randn(8, 64), torch.randint(0, 4, (8,)))

    def lower(comm):
        return compile_model(model, batch, F.cross_entropy, 4, plan, LoweringOptions(comm=comm, hosts=("h",) * 4),
                             mesh="dp=2,tp=2")

    auto, gloo = lower("auto"), lower("gloo")
    assert all(p.comm == "auto" for p in auto.values()) and all(p.comm == "gloo" for p in gloo.values())
    assert any("shm_flatten_all_reduce_start" in p.code for p in auto.values())  # a bucket of 256 KiB or more
    save_programs(auto, tmp_path / "auto")
    short = ShmShortfall(10 << 20, 8 << 20, 8 << 20)
    for r in range(4):
        loaded = load_program(tmp_path / "auto", r, 4)
        assert loaded.comm == "auto"
        for prog in (auto[r], loaded):
            use_gloo_for_axes(prog, {"dp": short})
            assert transports_of_code(prog.code, prog.group_names, prog.mesh) == {"dp": "gloo", "tp": "shm"}
            dp = [c for c in prog.collectives() if "adaptdist:dp" in c]
            assert dp == [c for c in gloo[r].collectives() if "adaptdist:dp" in c] and dp, (r, dp)
            use_gloo_for_axes(prog, {"tp": short})
            assert prog.collectives() == gloo[r].collectives(), r
            assert "adaptdist.shm_" not in prog.code
