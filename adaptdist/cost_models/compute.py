"""Compute time of one node: FLOPs and bytes moved against the device's peaks, plus a per-op overhead.

On a GPU (any device kind but ``cpu``)::

    time_s = max(flops / peak_flops[dtype], bytes / memory_bandwidth_bytes_per_s) + op_overhead_s

the roofline (Williams, Waterman & Patterson, "Roofline: an insightful visual performance model
for multicore architectures", CACM 52(4), 2009): a node is as slow as the slower of its
arithmetic and its memory traffic, which the GPU overlaps. On a CPU rank::

    time_s = flops / peak_flops[dtype] + bytes / memory_bandwidth_bytes_per_s + op_overhead_s

the two terms add: the core that computes also moves the operands, and a GEMM's packing of its
operand panels is a separate, memory-bound pass before the arithmetic (Goto & van de Geijn,
"Anatomy of high-performance matrix multiplication", ACM TOMS 34(3), 2008, s.5-6), which small
operands do not amortize. Measured on the 2-core development machine (torch 2.13, one thread per
rank; ``benchmarks/RESULTS.md``, cost-model accuracy): the GPT's ``[256, 192] x [192, 768]``
matmuls ran at 0.75-0.87 of the n = 1024 matmul rate that ``peak_flops`` holds; the additive form
predicts them within about 10%, the max form at the full rate. Large, compute-bound matmuls come
out a few percent slow (a 1024^3 matmul: +7%).

``op_overhead_s`` (:func:`~.hardware.op_overhead_s`, a device figure that ``adaptdist cluster
profile`` measures as the host time of one tiny ATen op call with every rank busy; 0 when absent)
is the fixed cost of dispatching one op from the generated Python program: the intercept of
time vs. size, as Hockney's latency term is for a message (Hockney 1994). It is charged for every
node that calls an ATen op (:func:`dispatches_op`): compute nodes here, and view ops, collective
issues and waits by :func:`~.estimate.rank_events`.

- FLOPs: torch's own formulas (``torch.utils.flop_counter``, the ones ``FlopCounterMode``
  uses: mm, addmm, bmm, baddbmm, convolution and its backward, the CUDA sdpa kernels), plus
  the ops it counts as zero that matter here. Measured on torch 2.13: ``FlopCounterMode``
  counts 0 for CPU attention, ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward; :func:`flop_formulas` adds them with the same counting as torch's
  ``sdpa_flop_count`` / ``sdpa_backward_flop_count`` (2 and 5 batched matmuls, causal
  masking not discounted). Elementwise ops and reductions count 0 FLOPs, as in torch; the
  bytes term prices them.
- bytes: every distinct tensor argument read once plus every output written once
  (elements of the tensor itself, not of the storage it views). View ops move nothing.
  ``addmm`` / ``baddbmm`` with ``beta != 0`` move two more outputs' worth (:func:`extra_bytes`):
  ATen's CPU kernel (``addmm_impl_cpu_`` in ``aten/src/ATen/native/LinearAlgebra.cpp``; CUDA's
  path without the cuBLASLt bias epilogue likewise) first copies the broadcast bias into the
  output, then runs the GEMM with ``beta = 1``, which reads the output back and writes it again.
  Measured on the 2-core machine (``benchmarks/RESULTS.md``): the GPT's ``addmm`` nodes ran 15-26%
  longer than its ``mm`` nodes of the same shapes, 39 us more per ``[256, 192]`` output and 83-118 us
  per ``[256, 768]`` one; the two extra passes predict 30 and 120 us.
- peak: ``peak_flops`` of the output's dtype name, else of ``"float32"``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .. import _torch_compat as compat
from .._torch_compat import tree_map
from ..errors import ClusterSpecError, UnsupportedOpError
from .hardware import DeviceLike, op_overhead_s
from .numbers import is_symbolic, smax
from .schedule import Ref, StepNode, StepSchedule, TensorSpec


def _bmm_flop(b, m, k, n):
    """2 m n k per batch (torch.utils.flop_counter.bmm_flop; FMA = 2 FLOPs)."""
    return 2 * b * m * n * k


def cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu`` (query ``[b, h, s_q, d]``, key
    ``[b, h_kv, s_k, d]``, value ``[b, h_kv, s_k, d_v]``): ``QK^T`` and ``PV`` as batched matmuls over
    the query heads (GQA key/value heads broadcast), as ``torch.utils.flop_counter.sdpa_flop_count``:
    ``2 b h s_q s_k d + 2 b h s_q s_k d_v``."""
    b, h, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return _bmm_flop(b * h, s_q, d_q, s_k) + _bmm_flop(b * h, s_q, s_k, d_v)


def cpu_flash_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                      **kwargs):
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: the scores recomputed and
    four gradient matmuls, as ``torch.utils.flop_counter.sdpa_backward_flop_count``:
    ``2 b h (s_q s_k d + s_q s_k d_v + s_k s_q d_v + s_q s_k d + d s_q s_k)``."""
    b, h, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return (_bmm_flop(b * h, s_q, d_q, s_k) + _bmm_flop(b * h, s_q, d_v, s_k) + _bmm_flop(b * h, s_k, s_q, d_v)
            + _bmm_flop(b * h, s_q, s_k, d_q) + _bmm_flop(b * h, d_q, s_q, s_k))


def _raw(formula: Callable) -> Callable:
    """A copy of a shape-wrapped formula marked ``_get_raw``, so ``FlopCounterMode`` calls it as it is
    (it takes tensors or shapes already) instead of wrapping it a second time."""
    @functools.wraps(formula)
    def call(*args: Any, **kwargs: Any) -> Any:
        return formula(*args, **kwargs)

    return compat.mark_flop_formula_raw(call)


def flop_formulas() -> dict[Any, Callable]:
    """A fresh registry, op overload packet -> FLOP formula: torch's ``flop_registry`` plus the CPU
    attention formulas above. Each is called as ``formula(*args, out_val=out, **kwargs)`` with tensors or
    shapes; usable as ``FlopCounterMode(custom_mapping=flop_formulas())`` (torch's own registry is not
    touched)."""
    import torch

    aten = torch.ops.aten
    out = {k: _raw(v) for k, v in compat.flop_formula_registry().items()}
    out[aten._scaled_dot_product_flash_attention_for_cpu] = _raw(compat.flop_shape_wrapper(cpu_flash_attention_flop))
    out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _raw(compat.flop_shape_wrapper(
        cpu_flash_attention_backward_flop))
    return out


@dataclass(frozen=True)
class NodeCost:
    """FLOPs and bytes moved by one compute node, and the dtype that picks the device's peak."""

    name: str
    flops: Any
    bytes: Any
    dtype: str


_BIAS_COPY_OPS = ("addmm", "baddbmm")


def extra_bytes(node: StepNode, outs: list[TensorSpec]) -> Any:
    """Memory traffic of ``node`` beyond reading its arguments and writing its outputs once, bytes:
    ``2 x`` the output for ``addmm`` / ``baddbmm`` with ``beta != 0`` (bias copied into the output, then
    read and written again by the GEMM; module docstring), else 0."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None or getattr(packet, "__name__", "") not in _BIAS_COPY_OPS or not outs:
        return 0
    beta = node.kwargs.get("beta", 1) if isinstance(node.kwargs, dict) else 1
    if isinstance(beta, (int, float)) and beta == 0:
        return 0
    return 2 * outs[0].nbytes


def node_cost(schedule: StepSchedule, node: StepNode, formulas: Mapping[Any, Callable]) -> NodeCost:
    """FLOPs (from ``formulas``; 0 when the op has none) and bytes moved (module docstring) of ``node``.

    Works on concrete and symbolic schedules: the formula receives shapes (tuples of ints or sympy
    expressions) in place of tensors.
    """
    outs = node.tensor_outputs()
    dtype = outs[0].dtype if outs else "float32"
    if node.kind != "compute":
        return NodeCost(node.name, 0, 0, dtype)
    moved: Any = 0
    for ref in node.refs():
        spec = schedule.spec(ref)
        for t in (spec if isinstance(spec, tuple) else (spec,)):
            if t is not None:
                moved = moved + t.nbytes
    for t in outs:
        moved = moved + t.nbytes
    moved = moved + extra_bytes(node, outs)
    flops: Any = 0
    packet = getattr(node.target, "overloadpacket", None)
    formula = formulas.get(packet) if packet is not None else None
    if formula is not None:
        def shape_of(a: Any) -> Any:
            if isinstance(a, Ref):
                spec = schedule.spec(a)
                if isinstance(spec, tuple):
                    return tuple(None if t is None else t.shape for t in spec)
                return spec.shape
            return a

        args = tree_map(shape_of, node.args, is_leaf=lambda x: isinstance(x, Ref))
        kwargs = tree_map(shape_of, node.kwargs, is_leaf=lambda x: isinstance(x, Ref))
        out_val = (tuple(None if t is None else t.shape for t in node.outputs) if node.multi_output
                   else outs[0].shape)
        try:
            flops = formula(*args, out_val=out_val, **kwargs)
        except (TypeError, AttributeError, ValueError) as e:
            flops = _formula_on_meta_tensors(schedule, node, formula, e)
    return NodeCost(node.name, flops, moved, dtype)


def _formula_on_meta_tensors(schedule: StepSchedule, node: StepNode, formula: Callable, error: Exception) -> Any:
    """Call a formula that needs tensors (torch registers some "raw") with meta tensors of the node's shapes.

    Raises:
        UnsupportedOpError: the shapes are symbolic, or the formula fails on meta tensors too.
    """
    import torch

    def meta(spec: TensorSpec | None) -> Any:
        if spec is None:
            return None
        if any(is_symbolic(d) for d in spec.shape):
            raise UnsupportedOpError(f"the FLOP formula of {node.target} (node {node.name}) needs tensors, so it "
                                     f"cannot be costed symbolically: {type(error).__name__}: {error}")
        return torch.empty([int(d) for d in spec.shape], dtype=getattr(torch, spec.dtype), device="meta")

    def to_tensor(a: Any) -> Any:
        if isinstance(a, Ref):
            spec = schedule.spec(a)
            return tuple(meta(t) for t in spec) if isinstance(spec, tuple) else meta(spec)
        return a

    args = tree_map(to_tensor, node.args, is_leaf=lambda x: isinstance(x, Ref))
    kwargs = tree_map(to_tensor, node.kwargs, is_leaf=lambda x: isinstance(x, Ref))
    outs = tuple(meta(t) for t in node.outputs)
    try:
        return formula(*args, out_val=outs if node.multi_output else outs[0], **kwargs)
    except Exception as e:  # noqa: BLE001 - reported with the op
        raise UnsupportedOpError(f"the FLOP formula of {node.target} (node {node.name}) failed: "
                                 f"{type(e).__name__}: {e}") from e


def peak_flops_per_s(device: DeviceLike, dtype: str) -> float:
    """The device's peak FLOP/s for ``dtype`` (a name such as ``"bfloat16"``), else for float32.

    Raises:
        ClusterSpecError: the device lists neither.
    """
    peaks = device.peak_flops
    if dtype in peaks:
        return float(peaks[dtype])
    if "float32" in peaks:
        return float(peaks["float32"])
    raise ClusterSpecError(f"device of rank {device.rank} ({device.kind} on {device.host}) gives peak_flops for "
                           f"{sorted(peaks)} but not for {dtype!r} or float32; add a float32 figure")


def roofline_time_s(flops: Any, bytes_moved: Any, peak_flops: float, memory_bandwidth_bytes_per_s: float,
                    overlap: bool = True) -> Any:
    """``max(flops / peak_flops, bytes_moved / memory_bandwidth_bytes_per_s)`` in seconds (Williams 2009);
    with ``overlap=False`` the sum of the two (arithmetic and memory traffic one after the other, as on a
    CPU core: see the module docstring).

    Args: flops (FLOP), bytes_moved (B), peak_flops (FLOP/s), memory_bandwidth_bytes_per_s (B/s);
    numbers or sympy expressions.
    """
    if isinstance(flops, (int, float)) and flops == 0:
        return bytes_moved / memory_bandwidth_bytes_per_s
    if not overlap:
        return flops / peak_flops + bytes_moved / memory_bandwidth_bytes_per_s
    return smax(flops / peak_flops, bytes_moved / memory_bandwidth_bytes_per_s)


def overlaps_compute_and_memory(device: DeviceLike) -> bool:
    """Whether ``device`` overlaps a node's arithmetic with its memory traffic: GPUs yes (the roofline's
    max), CPU ranks no (the sum); see the module docstring."""
    return str(getattr(device, "kind", "cpu")) != "cpu"


def dispatches_op(node: StepNode) -> bool:
    """Whether running ``node`` calls an ATen (or c10d functional) op, which costs the device's
    ``op_overhead_s``: its target is an op overload; placeholders, the output and Python's
    ``operator.getitem`` on a tuple are not."""
    return node.kind not in ("input", "constant", "output") and hasattr(node.target, "overloadpacket")


def node_time_s(cost: NodeCost, device: DeviceLike) -> Any:
    """Time of one compute node's :class:`NodeCost` on ``device``, seconds: the roofline (max on a GPU, sum on a
    CPU) plus the device's per-op overhead (module docstring). Raises as :func:`peak_flops_per_s`."""
    return roofline_time_s(cost.flops, cost.bytes, peak_flops_per_s(device, cost.dtype),
                           float(device.memory_bandwidth_bytes_per_s),
                           overlap=overlaps_compute_and_memory(device)) + op_overhead_s(device)
