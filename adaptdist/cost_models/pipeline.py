"""Analytic step time, bubble and in-flight activations of pipeline schedules.

A pipeline of ``p`` stages runs ``m`` microbatches. Stage ``i`` spends, per microbatch, ``F_i`` seconds on
the forward, ``B_i`` on the input-gradient part of the backward and ``W_i`` on the weight-gradient part
(``t_i = F_i + B_i + W_i``). The formulas (seconds, one training step, the optimizer not included):

- **GPipe** (Huang et al., NeurIPS 2019) and **1F1B** (PipeDream-Flush, Narayanan et al., ICML 2021):
  ``T = sum_i t_i + (m - 1) * max_i t_i``, Alpa's latency of a pipeline (Zheng et al., OSDI 2022, s.5.1,
  eq. 2). The bubble (idle time of the busiest stage) is ``sum_i t_i - max_i t_i``; for equal stages
  ``(p - 1) t``, the fraction ``(p - 1) / (m + p - 1)``. In flight on stage ``i`` (0-based): GPipe keeps
  every microbatch's activations (``m``), 1F1B at most ``min(m, p - i)``.
- **Interleaved 1F1B** (Narayanan et al., SC 2021) with ``v`` model chunks per device: the bubble shrinks by
  ``v``: ``T = m * max_i t_i + (sum_i t_i - max_i t_i) / v``; it needs ``m % p == 0`` (Megatron-LM's
  rule) and every stage splittable into ``v`` chunks; each stage boundary is crossed ``v`` times per
  microbatch (the caller adds that communication). In flight on stage ``i``: Megatron-LM's warm-up of
  ``2 (p - i - 1) + (v - 1) p`` chunk-microbatches plus one, each holding ``1/v`` of the stage's
  activations, at most ``m`` whole microbatches.
- **ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, s.3.1): the weight-gradient passes
  are deferred into the bubble, which shrinks from ``(p - 1)(F + B + W)`` (1F1B) to ``(p - 1)(F + B - W)``
  for equal stages, with 1F1B's peak memory. For unequal stages the same saving per stage:
  ``T = m * max_i t_i + max(0, sum_{i != b} (F_i + B_i - W_i))``, ``b`` the slowest stage. With ``W = 0``
  it is 1F1B.

All functions take per-stage sequences of equal length ``p >= 1``; a one-stage pipeline has no bubble.

**One microbatch's F, B and W** (:func:`microbatch_times`): not the whole batch's time over ``m``. A stage's
compute for the whole batch (``C``, split ``C_F, C_B, C_W``) counts every op's memory traffic once; but part of that
traffic does not shrink with the microbatch (``X_F, X_B, X_W`` seconds at the device's memory bandwidth): a
microbatch of any size reads the whole weight in its forward and its input gradient and writes the whole weight
gradient, and the pipeline executor then adds that gradient into the step's (``runtime/pipeline_executor.py``:
the first microbatch's ``clone``, 2 passes over the gradient bytes ``G``; each later one's ``add_``, 3 passes: an
elementwise op's traffic, inputs read once and the output written once). So on a CPU, where a node's time is the
sum of its arithmetic and its traffic (:mod:`.compute`)::

    F = C_F / m + X_F (1 - 1/m) + ovh_F + h/2      B = C_B / m + X_B (1 - 1/m) + ovh_B + h/2
    W = C_W / m + X_W (1 - 1/m) + ovh_W + (3 - 1/m) G            (``G`` in seconds: bytes / bandwidth)

and on a device that overlaps the two (a GPU's roofline max), ``max(C_x / m, X_x)`` instead of the first two terms.
``ovh`` is the op dispatch of one microbatch, ``h`` :data:`EXECUTOR_MICROBATCH_HOST_S`. Measured
(benchmarks/RESULTS.md, "the pipelines' per-microbatch traffic"): on WideMLP 8 x Linear(1024, 1024), 2 stages,
512 rows, the forward of one stage took 15.7 ms per microbatch at m = 4 and 9.0 ms at m = 8, i.e.
``53.6 ms / m + 2.3 ms``, the backward ``100 ms / m + 8 ms``: the per-microbatch intercepts are the weight traffic
(16 MiB of weights read by F; read by B, written as the gradient and added up by W) at the profiled memory
bandwidth, which ``C / m`` alone leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import UsageError

SCHEDULES = ("1f1b", "gpipe", "zb", "interleaved-1f1b")
"""The schedules the planner weighs, in its order of preference on ties (1F1B before GPipe: the same time in
less memory; the split backward and the interleaving only where they are predicted faster)."""

INTERLEAVE_CHUNKS = 2
"""Model chunks per device the planner predicts interleaved 1F1B with."""

EXECUTOR_MICROBATCH_HOST_S = 0.25e-3
"""Host seconds the pipeline executor (``runtime/pipeline_executor.py``) spends per microbatch and stage (model
chunk) beyond the stage programs' own op dispatch: slicing the microbatch's rows, posting its sends and receives,
the action loop's bookkeeping. Measured by ``benchmarks/bench_pp_overhead.py`` (main-thread CPU time, so
descheduling does not count): 0.21-0.40 ms with the trace on, about 0.2 ms without, on 2 gloo ranks of 1 thread
each, every schedule, m = 4 and 8 (benchmarks/RESULTS.md, "bench_pp_bubble: posted sends and receives").
The planner adds half to a stage's forward and half to its input-gradient time (:func:`microbatch_times`)."""

GRAD_ADD_PASSES = 3
"""Passes over a stage's gradient bytes per microbatch when the pipeline executor adds a microbatch's gradients into
the step's (``grads[f].add_(g)`` in ``runtime/pipeline_executor.py``: two tensors read, one written; the first
microbatch's ``clone`` makes 2, hence ``3 - 1/m`` on average): an elementwise op's traffic as the compute model
counts it (:mod:`.compute`), priced at the profiled elementwise-add bandwidth (``memory_bandwidth_bytes_per_s``,
``adaptdist cluster profile``)."""


def microbatch_times(compute_s: float, fractions: Sequence[float], overhead_s: float,
                     overhead_fractions: Sequence[float], microbatches: int,
                     fixed_s: Sequence[float] = (0.0, 0.0, 0.0), grad_add_s: float = 0.0,
                     overlapped: bool = False, replicas: int = 1) -> tuple[float, float, float]:
    """(F, B, W) seconds of one of ``microbatches`` microbatches on one stage (module docstring).

    Args:
        compute_s: the stage's compute for the whole batch, seconds; ``fractions`` its F/B/W shares.
        overhead_s: op dispatch of one microbatch, seconds; ``overhead_fractions`` its F/B/W shares.
        fixed_s: F/B/W seconds per device of the traffic a microbatch pays whole (``X_x``).
        grad_add_s: one pass over the stage's gradient bytes per device at memory bandwidth (``G``), seconds.
        overlapped: arithmetic and traffic overlap (a GPU): ``max(C_x / m, X_x)``, else ``C_x / m + X_x (1 - 1/m)``.
        replicas: the ways ``compute_s`` was split over the stage's batch axis, each replica still reading the whole
            weights: ``compute_s`` then holds ``X_x / replicas``, and the sum form is ``C_x / m + X_x (1 - 1/(r m))``.

    Raises:
        UsageError: fewer than 1 microbatch.
    """
    m = microbatches
    if m < 1:
        raise UsageError(f"a pipeline needs at least 1 microbatch, got {m}")
    host = (EXECUTOR_MICROBATCH_HOST_S / 2, EXECUTOR_MICROBATCH_HOST_S / 2, 0.0)
    add = (0.0, 0.0, (GRAD_ADD_PASSES - 1.0 / m) * grad_add_s)
    out = []
    for f, o, x, h, a in zip(fractions, overhead_fractions, fixed_s, host, add):
        share = compute_s * f / m
        work = max(share, x) if overlapped else share + x * (1.0 - 1.0 / (m * max(1, replicas)))
        out.append(work + overhead_s * o + h + a)
    return out[0], out[1], out[2]


@dataclass(frozen=True)
class ScheduleEstimate:
    """One schedule's prediction for one pipeline.

    Attributes:
        schedule: its name (:data:`SCHEDULES`). microbatches: ``m``.
        step_s: predicted pipeline time of a step, seconds (before the gradient sync after the flush).
        bubble_s: idle time of the slowest stage, seconds. bubble_fraction: ``bubble_s / step_s``.
        in_flight: microbatches of activations each stage keeps at its peak (may be fractional: chunks).
        why_not: None, or why the schedule cannot run this pipeline (then ``step_s`` is inf).
    """

    schedule: str
    microbatches: int
    step_s: float
    bubble_s: float
    bubble_fraction: float
    in_flight: tuple[float, ...]
    why_not: str | None = None


def _check(forward_s: Sequence[float], backward_s: Sequence[float], weight_s: Sequence[float], m: int) -> int:
    p = len(forward_s)
    if p < 1 or len(backward_s) != p or len(weight_s) != p:
        raise UsageError(f"per-stage times need one entry per stage, got {len(forward_s)}, {len(backward_s)} and "
                         f"{len(weight_s)}")
    if m < 1:
        raise UsageError(f"a pipeline needs at least 1 microbatch, got {m}")
    return p


def in_flight_microbatches(schedule: str, num_stages: int, microbatches: int,
                           chunks: int = INTERLEAVE_CHUNKS) -> tuple[float, ...]:
    """Microbatches of activations stage ``i`` holds at its peak, per stage (module docstring).

    Raises:
        UsageError: an unknown schedule.
    """
    p, m = num_stages, microbatches
    if schedule == "gpipe":
        return tuple(float(m) for _ in range(p))
    if schedule in ("1f1b", "zb"):
        return tuple(float(min(m, p - i)) for i in range(p))
    if schedule == "interleaved-1f1b":
        v = chunks
        return tuple(min(float(m), (2 * (p - i - 1) + (v - 1) * p + 1) / v) for i in range(p))
    raise UsageError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")


def schedule_estimate(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float],
                      weight_s: Sequence[float], microbatches: int, chunks: int = INTERLEAVE_CHUNKS,
                      layers_per_stage: Sequence[int] | None = None) -> ScheduleEstimate:
    """Predicted step of ``schedule`` on stages with these per-microbatch times (seconds; formulas in the module
    docstring). ``layers_per_stage`` (for interleaved 1F1B): each stage must hold at least ``chunks`` layers.

    Raises:
        UsageError: an unknown schedule, mismatched lengths or fewer than 1 microbatch.
    """
    p = _check(forward_s, backward_s, weight_s, microbatches)
    m = microbatches
    t = [f + b + w for f, b, w in zip(forward_s, backward_s, weight_s)]
    slow = max(range(p), key=lambda i: t[i])
    t_max = t[slow]
    flight = in_flight_microbatches(schedule, p, m, chunks)
    why_not = None
    if schedule in ("gpipe", "1f1b"):
        bubble = sum(t) - t_max
    elif schedule == "zb":
        bubble = max(0.0, sum(forward_s[i] + backward_s[i] - weight_s[i] for i in range(p) if i != slow))
    elif schedule == "interleaved-1f1b":
        bubble = (sum(t) - t_max) / chunks
        if p < 2:
            why_not = "needs at least 2 stages"
        elif m % p:
            why_not = f"needs the microbatches ({m}) to be a multiple of the stages ({p})"
        elif layers_per_stage is not None and min(layers_per_stage) < chunks:
            why_not = f"needs at least {chunks} layers on every stage (model chunks per device)"
    else:
        raise UsageError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if why_not is not None:
        return ScheduleEstimate(schedule, m, float("inf"), float("inf"), 1.0, flight, why_not)
    step = m * t_max + bubble
    return ScheduleEstimate(schedule, m, step, bubble, bubble / step if step > 0 else 0.0, flight)


def pipeline_latency_s(stage_s: Sequence[float], microbatches: int) -> float:
    """Alpa's pipeline latency ``sum_i t_i + (m - 1) max_i t_i`` (GPipe and 1F1B), seconds."""
    if not stage_s:
        raise UsageError("a pipeline needs at least one stage")
    return float(sum(stage_s) + (microbatches - 1) * max(stage_s))
