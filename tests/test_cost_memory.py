"""Liveness peak memory: a hand-built graph against a hand count, and a lowered MLP against the measured metric."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from adaptdist import _torch_compat as compat
from adaptdist.cost_models.memory import estimate_memory, live_storages, optimizer_model, program_peak
from adaptdist.cost_models.schedule import schedule_from_graph
from adaptdist.errors import UsageError
from adaptdist.runtime.memory import PeakMemory
from models import MLP

F32 = torch.float32


def _step(w, x):
    mm = torch.mm(x, w)        # [4, 8]  128 B
    relu = torch.relu(mm)      # [4, 8]  128 B (mm dies here)
    t = relu.t()               # a view: no storage
    g = torch.mm(t, x)         # [8, 8]  256 B, the "gradient"
    loss = relu.sum()          # []        4 B (relu dies here)
    return loss, g


@pytest.fixture
def hand_graph():
    gm = compat.trace_fake(_step, [([8, 8], F32), ([4, 8], F32)])
    return gm, schedule_from_graph(gm, ["param:w", "batch:0"], ["loss", "grad:w"], param_fqns=["w"])


def test_liveness_peak_equals_the_hand_count(hand_graph):
    gm, s = hand_graph
    # inputs w (256) + x (128) live throughout = 384
    # mm: +128 = 512; relu: +128 = 640; mm_1 (g): mm freed, +256 = 768; sum: +4 = 772; end: relu freed = 644
    peak, at = program_peak(s)
    assert (peak, s.nodes[at].name) == (772, "sum_1")
    assert sum(s.storages[k].nbytes for k in live_storages(s, s.end)) == 644
    sgd = estimate_memory(s, "sgd")
    assert (sgd.peak_bytes, sgd.peak_at, sgd.params_bytes, sgd.grads_bytes) == (772, "sum_1", 256, 256)
    # adamw: state 2 * 256 + 4 (step); step(): 644 live + state + 2 * 256 temporaries = 1672 > 772 + 516
    adam = estimate_memory(s, "adamw")
    assert (adam.peak_bytes, adam.peak_at) == (1672, "optimizer.step")
    assert (adam.optimizer_state_bytes, adam.optimizer_temp_bytes, adam.activations_bytes) == (516, 512, 132)
    # and the measured metric agrees with the liveness analysis
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    with PeakMemory([w, x]) as pm:
        gm(w, x)
    assert pm.report.peak_bytes == 772


def test_optimizer_state_and_temporaries_by_hand():
    sizes = [100, 40, 200]
    adam = optimizer_model("adam")
    assert adam.state_bytes(sizes) == 2 * 340 + 3 * 4
    assert adam.temporary_bytes(sizes) == max(2 * 100, 2 * 40 + 100, 2 * 200 + 40)
    assert optimizer_model("sgd-momentum").state_bytes(sizes) == 340
    assert optimizer_model("sgd").state_bytes(sizes) == 0 == optimizer_model("sgd").temporary_bytes(sizes)
    with pytest.raises(UsageError, match="lion"):
        optimizer_model("lion")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    compat.register_process_group("adaptdist:dp", dist.group.WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_mlp_dp_estimate_within_10_percent_of_measured(one_rank_group, optimizer):
    """Rank 0's program of a 2-rank DP lowering, run for real (a 1-rank group: collectives are identities
    with the same allocations), measured with runtime/memory.py around its second step."""
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.cost_models.estimate import estimate_programs
    from adaptdist.cost_models.hardware import FixedCluster
    from adaptdist.runtime.worker import StepRunner

    torch.manual_seed(0)
    model = MLP(64, 256, 10)
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    programs = compile_model(model, batch, F.cross_entropy, 2)
    est = estimate_programs(programs, FixedCluster.uniform([("h", 2)]), optimizer).ranks[0].memory
    prog = programs[0]
    runner = StepRunner(prog, optimizer, 1e-3)
    local = tuple(t.clone() for t in prog.local_batch(batch))  # this rank's rows only
    runner.step(local)                                         # the optimizer makes its state
    with PeakMemory([runner.state, runner.opt.state_dict()["state"], local]) as pm:
        runner.step(local)
    measured = pm.report.peak_bytes
    assert abs(est.peak_bytes - measured) <= 0.10 * measured, (est, measured)
    assert est.peak_bytes == (est.params_bytes + est.grads_bytes + est.optimizer_state_bytes
                              + est.optimizer_temp_bytes + est.activations_bytes)
    assert est.params_bytes == sum(p.numel() * 4 for p in model.parameters())
