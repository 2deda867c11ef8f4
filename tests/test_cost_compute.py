"""FLOP formulas, bytes moved and the roofline against hand computations."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from adaptdist import _torch_compat as compat
from adaptdist.cost_models.compute import flop_formulas, node_cost, node_time_s, peak_flops_per_s, roofline_time_s
from adaptdist.cost_models.hardware import DeviceFigures
from adaptdist.cost_models.schedule import schedule_from_graph
from adaptdist.errors import ClusterSpecError

F32 = torch.float32


def test_cpu_flash_attention_counts_zero_in_torch_and_ours_count_the_matmuls():
    b, h, s, d = 2, 3, 5, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert plain.get_total_flops() == 0  # measured: torch has no formula for the CPU kernels
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as ours:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    counts = ours.get_flop_counts()["Global"]
    fwd = counts[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu]
    bwd = counts[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward]
    assert fwd == 2 * (2 * b * h * s * s * d)      # QK^T and PV
    assert bwd == 5 * (2 * b * h * s * s * d)      # scores recomputed + dV, dP, dQ, dK


def test_gqa_attention_counts_query_heads():
    b, hq, hkv, s, d = 1, 4, 2, 6, 8
    q = torch.randn(b, hq, s, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as c:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k.repeat_interleave(2, 1),
                                                                   v.repeat_interleave(2, 1))
    assert c.get_total_flops() == 4 * b * hq * s * s * d


def _schedule(fn, specs):
    gm = compat.trace_fake(fn, specs)
    n_in = len(specs)
    return schedule_from_graph(gm, [f"batch:{i}" for i in range(n_in)], ["output"])


def test_mm_flops_and_bytes_moved_by_hand():
    s = _schedule(lambda x, w: torch.mm(x, w).relu(), [([4, 8], F32), ([8, 16], F32)])
    formulas = flop_formulas()
    by_name = {n.name: n for n in s.nodes}
    mm = node_cost(s, by_name["mm"], formulas)
    assert mm.flops == 2 * 4 * 8 * 16
    assert mm.bytes == (4 * 8 + 8 * 16 + 4 * 16) * 4       # read x, w; write out
    relu = node_cost(s, by_name["relu"], formulas)
    assert relu.flops == 0 and relu.bytes == 2 * 4 * 16 * 4  # elementwise: read + write


def test_views_move_nothing_and_bmm_addmm_counts():
    def fn(x, w, bias, a, c):
        t = w.t()                       # a view
        y = torch.addmm(bias, x, t)     # [4, 6] = [4, 8] @ [8, 6]
        z = torch.bmm(a, c)             # [3, 2, 5] @ [3, 5, 7]
        return y, z

    s = _schedule(fn, [([4, 8], F32), ([6, 8], F32), ([6], F32), ([3, 2, 5], F32), ([3, 5, 7], F32)])
    f = flop_formulas()
    by = {n.name: n for n in s.nodes}
    assert by["t"].kind == "view" and node_cost(s, by["t"], f).bytes == 0
    assert node_cost(s, by["addmm"], f).flops == 2 * 4 * 8 * 6
    # bias, x, w read once, the [4, 6] output written once -- and twice more: ATen copies the broadcast
    # bias into the output, then the GEMM (beta = 1) reads it back and writes it again
    assert node_cost(s, by["addmm"], f).bytes == (6 + 4 * 8 + 8 * 6 + 4 * 6 + 2 * 4 * 6) * 4
    assert node_cost(s, by["bmm"], f).flops == 2 * 3 * 2 * 5 * 7
    assert node_cost(s, by["bmm"], f).bytes == (3 * 2 * 5 + 3 * 5 * 7 + 3 * 2 * 7) * 4  # no bias: no extra pass


def test_addmm_without_bias_term_moves_no_extra_bytes():
    s = _schedule(lambda bias, x, w: torch.addmm(bias, x, w, beta=0), [([6], F32), ([4, 8], F32), ([8, 6], F32)])
    addmm = next(n for n in s.nodes if n.name == "addmm")
    assert node_cost(s, addmm, flop_formulas()).bytes == (6 + 4 * 8 + 8 * 6 + 4 * 6) * 4


def test_roofline_picks_the_slower_bound():
    assert roofline_time_s(2e12, 1e9, 1e12, 1e10) == pytest.approx(2.0)     # compute-bound
    assert roofline_time_s(1e9, 5e10, 1e12, 1e10) == pytest.approx(5.0)     # memory-bound
    assert roofline_time_s(0, 1e10, 1e12, 1e10) == pytest.approx(1.0)


def test_peak_by_dtype_with_float32_fallback():
    dev = DeviceFigures(0, "h", "cuda", {"float32": 1e13, "bfloat16": 1e14}, 2**30, 1e12)
    assert peak_flops_per_s(dev, "bfloat16") == 1e14
    assert peak_flops_per_s(dev, "float64") == 1e13
    no_fp32 = DeviceFigures(0, "h", "cuda", {"bfloat16": 1e14}, 2**30, 1e12)
    with pytest.raises(ClusterSpecError, match="float32"):
        peak_flops_per_s(no_fp32, "float64")


def test_node_time_on_a_device():
    s = _schedule(lambda x, w: torch.mm(x, w), [([64, 64], F32), ([64, 64], F32)])
    mm = node_cost(s, next(n for n in s.nodes if n.name == "mm"), flop_formulas())
    flop_s, mem_s = 2 * 64**3 / 1e9, 3 * 64 * 64 * 4 / 1e9
    gpu = DeviceFigures(0, "h", "cuda", {"float32": 1e9}, 2**30, 1e9)
    assert node_time_s(mm, gpu) == pytest.approx(max(flop_s, mem_s))  # roofline: the GPU overlaps the two
    cpu = DeviceFigures(0, "h", "cpu", {"float32": 1e9}, 2**30, 1e9)
    assert node_time_s(mm, cpu) == pytest.approx(flop_s + mem_s)  # one CPU core does one after the other


def test_views_of_a_waited_bucket_alias_the_collectives_storage():
    # a gradient bucket: cat, all_reduce, wait, split back into gradients. At run time wait_tensor returns the
    # collective's output and split_with_sizes views it: no new storage, no bytes moved (before, the fake run's
    # copy made the split a "compute" node moving the whole bucket)
    def fn(a, b):
        bucket = torch.cat([a.reshape(-1), b.reshape(-1)])
        red = torch.ops._c10d_functional.all_reduce.default(bucket, "sum", "g")
        red = torch.ops._c10d_functional.wait_tensor.default(red)
        ga, gb = torch.ops.aten.split_with_sizes.default(red, [12, 8])
        return ga.view(3, 4), gb.view(2, 4)

    s = _schedule(fn, [([3, 4], F32), ([2, 4], F32)])
    coll = next(n for n in s.nodes if n.kind == "collective")
    wait = next(n for n in s.nodes if n.kind == "wait")
    split = next(n for n in s.nodes if "split_with_sizes" in str(n.target))
    assert wait.waits_on == coll.index
    assert split.kind == "view" and node_cost(s, split, flop_formulas()).bytes == 0
    assert {t.storage for t in split.tensor_outputs()} == {coll.outputs[0].storage}
