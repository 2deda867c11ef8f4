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
The planner adds half to a stage's forward and half to its input-gradient time
(:meth:`adaptdist.compiler.planner.stages.StageEstimate.per_microbatch`)."""


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
