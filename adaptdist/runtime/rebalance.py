"""Adaptive re-balance: uneven data-parallel batch rows re-chosen from the speeds measured in the run.

The planner splits the batch by each device's profiled speed (:mod:`adaptdist.compiler.device_placement`). A
profile taken before the run can be off: on a 2-core machine with ranks pinned to cores [0], [0], [1], ``cluster
profile`` measured the lone rank at 1.65-1.82x the FLOP/s of the two sharing core 0, while in the job it ran
2.0x as fast (benchmarks/RESULTS.md), so the split under-loaded it. So, after ``measure_steps`` steps:

1. each rank measures its compute per step: its step window minus its waits on collectives
   (:class:`ComputeMeter`, through the :mod:`.trace` instrumentation), median over the window;
2. the ranks share those medians (and their standard errors); rank 0 scales each rank's predicted compute (the cost model of the current
   programs: a fixed part, the optimizer step, and a per-row part) by measured / predicted and chooses new rows
   (:func:`~adaptdist.compiler.device_placement.balanced_batch_rows`: the slowest rank's time least, within each
   device's memory) -- :func:`adaptdist.compiler.rebalance_rows.decide` (the compiler's layer: it prices the
   programs);
3. when the slowest rank's time falls by at least ``min_gain`` under that model, and by more than twice the
   measurements' noise (the largest relative standard error of a rank's median: a window that one slow spell
   skewed must not move rows that were right), the programs are lowered again
   with those rows (the one door: ``compile_model(..., batch_split=rows)``) and every rank moves its parameters,
   buffers and optimizer state into its new program (:func:`transfer_state`).

The global batch and the loss scaling do not change: ``passes/globalize_reductions.py`` divides by the global
count whatever the split, so the step stays equal to the single-process one (``tests/test_rebalance.py``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import AdaptdistError
from .trace import TraceRecorder


@dataclass(frozen=True)
class RebalanceDecision:
    """What the re-balance after step ``step`` (1-based: the steps measured so far) found and did.

    Attributes:
        rows_before, rows_after: rows per coordinate of the batch axis (equal when not applied).
        measured_compute_s: per program rank, its median compute per step in the run (step minus waits), seconds.
        predicted_compute_s: per program rank, the cost model's compute for the rows it had, seconds.
        slowest_before_s, slowest_after_s: the slowest coordinate's compute per step under the measured model
            (predicted scaled by measured / predicted) for the old and the new rows, seconds.
        applied: whether the programs were lowered again with ``rows_after``.
        reason: one line, why.
        noise: the largest relative standard error of a rank's measured median (:func:`median_and_noise`).
        threshold: the predicted gain a re-lowering needed (at least ``1 + min_gain``, and beyond the noise).
    """

    step: int
    rows_before: tuple[int, ...]
    rows_after: tuple[int, ...]
    measured_compute_s: tuple[float, ...]
    predicted_compute_s: tuple[float, ...]
    slowest_before_s: float
    slowest_after_s: float
    applied: bool
    reason: str
    noise: float = 0.0
    threshold: float = 1.0

    @property
    def predicted_gain(self) -> float:
        """slowest_before_s / slowest_after_s (1.0: nothing to gain)."""
        return self.slowest_before_s / self.slowest_after_s if self.slowest_after_s > 0 else 1.0

    def to_doc(self) -> dict:
        d = asdict(self)
        d["predicted_gain"] = self.predicted_gain
        return d

    def line(self) -> str:
        meas = ", ".join(f"{1e3 * t:.1f}" for t in self.measured_compute_s)
        pred = ", ".join(f"{1e3 * t:.1f}" for t in self.predicted_compute_s)
        head = (f"re-balance after step {self.step}: measured compute per rank [{meas}] ms (+-{100 * self.noise:.1f}%; "
                f"predicted [{pred}] ms) for rows {list(self.rows_before)}")
        if not self.applied:
            return f"{head}: kept ({self.reason})"
        return (f"{head}: rows -> {list(self.rows_after)}, slowest rank {1e3 * self.slowest_before_s:.1f} -> "
                f"{1e3 * self.slowest_after_s:.1f} ms predicted ({self.predicted_gain:.3f}x; {self.reason})")


class ComputeMeter:
    """Each step's compute seconds on this rank: the step window minus the waits on collectives.

    Uses ``recorder`` when it records (``--trace``); else a recorder of its own, instrumenting ``runner``'s
    program until :meth:`detach` (three clock reads per collective).
    """

    def __init__(self, runner: Any, recorder: TraceRecorder | None = None):
        self.runner = runner
        if recorder is not None and recorder.enabled:
            self.recorder, self.own = recorder, False
        else:
            self.recorder, self.own = TraceRecorder(runner.program.rank), True
            runner.use_trace(self.recorder)

    def step(self, step: int):
        """Context manager around step ``step`` (0-based); a no-op when the job's own recorder frames it."""
        return self.recorder.step(step) if self.own else contextlib.nullcontext()

    def compute_s(self, steps: Iterable[int]) -> list[float]:
        """Compute seconds of each of ``steps`` recorded (step window minus its ``wait`` spans)."""
        return step_compute_s(self.recorder, steps)

    def detach(self) -> None:
        """Stop instrumenting the runner (its own recorder only)."""
        if self.own:
            self.runner.use_trace(TraceRecorder(self.runner.program.rank, enabled=False))


def step_compute_s(recorder: TraceRecorder, steps: Iterable[int]) -> list[float]:
    """Per step of ``steps`` that ``recorder`` framed: its window's seconds minus its ``wait`` spans' (seconds)."""
    wanted = set(steps)
    waits: dict[int, float] = {}
    for s in recorder.spans:
        if s.kind == "wait" and s.step in wanted:
            waits[s.step] = waits.get(s.step, 0.0) + s.duration_s
    return [w.duration_s - waits.get(w.step, 0.0) for w in recorder.steps if w.step in wanted]


def transfer_state(old: Any, new: Any) -> None:
    """Copy ``old``'s (a :class:`~.worker.StepRunner`) parameters, buffers and optimizer state into ``new``, a
    runner of the same rank's program lowered with other batch rows (the same state, names and shapes).

    Raises:
        AdaptdistError: the two programs hold different state (names or shapes).
    """
    a, b = old.program, new.program
    if list(a.param_fqns) != list(b.param_fqns) or set(old.state) != set(new.state) or any(
            old.state[k].shape != new.state[k].shape for k in old.state):
        raise AdaptdistError(f"re-balance: rank {a.rank}'s new program holds other state than its current one "
                             "(only the batch rows may differ); keeping the current rows")
    with torch.no_grad():
        for k, v in old.state.items():
            new.state[k].copy_(v)
    new.opt.load_state_dict(old.opt.state_dict())


def agree(rank: int, world: int, own: tuple[float, float],
          decide_and_lower: Callable[[list[float], list[float]], tuple[RebalanceDecision, str | None]]
          ) -> tuple[RebalanceDecision | None, str | None, str | None]:
    """(Collective over the world) every rank's ``own`` (:func:`compute_summary`: its median compute seconds per
    step and that median's relative standard error) to rank 0, which calls ``decide_and_lower`` (medians per rank,
    errors per rank -> the decision and, when applied, the directory of the new programs); its answer
    goes to every rank: ``(decision, directory, None)``, or ``(None, None, error text)`` when rank 0's call failed
    (a re-balance is an optimization: the job keeps its rows and goes on).
    """
    import torch.distributed as dist

    got: list = [None] * world
    dist.all_gather_object(got, (float(own[0]), float(own[1])))
    answer: list = [None]
    if rank == 0:
        try:
            answer[0] = ("ok", decide_and_lower([float(x[0]) for x in got], [float(x[1]) for x in got]))
        except Exception as e:  # noqa: BLE001 - every rank must hear it, or the others wait forever
            answer[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(answer, src=0)
    status, payload = answer[0]
    if status != "ok":
        return None, None, payload
    return payload[0], payload[1], None


def median_and_noise(xs: Sequence[float]) -> tuple[float, float]:
    """The median of ``xs`` (seconds per step) and its relative standard error: 1.2533 sigma / sqrt(n) / median,
    sigma estimated robustly as 1.4826 x the median absolute deviation (the normal distribution's; the median's
    standard error is sqrt(pi / 2) sigma / sqrt(n), Kendall & Stuart). ``(nan, 0.0)`` for none, ``(x, 0.0)`` for
    one."""
    if not xs:
        return float("nan"), 0.0
    med = statistics.median(xs)
    if len(xs) < 2 or med <= 0:
        return med, 0.0
    mad = statistics.median(abs(x - med) for x in xs)
    return med, 1.2533 * 1.4826 * mad / math.sqrt(len(xs)) / med


def compute_summary(meter: ComputeMeter, steps: Iterable[int]) -> tuple[float, float]:
    """:func:`median_and_noise` of :meth:`ComputeMeter.compute_s` over ``steps``."""
    return median_and_noise(meter.compute_s(steps))
