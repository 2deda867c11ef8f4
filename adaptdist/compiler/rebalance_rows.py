"""The rows an adaptive re-balance chooses from the compute each rank measured in the run.

:func:`decide` prices the running programs with the cost model on the job's cluster, scales each rank's predicted
compute (a fixed part, the optimizer step, and a per-row part) by its measured / predicted ratio, and asks
:func:`~.device_placement.balanced_batch_rows` for the rows that make the slowest rank fastest within each
device's memory. The runtime side (measuring, agreeing, moving the state) is :mod:`adaptdist.runtime.rebalance`.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import AdaptdistError
from ..runtime.rebalance import RebalanceDecision

DEFAULT_MIN_GAIN = 0.02
"""Re-lower only when the slowest rank's predicted compute falls by at least this fraction (a re-lowering costs a
capture and two lowerings on rank 0, seconds)."""

NOISE_SIGMAS = 2.0
"""...and by more than this many relative standard errors of the noisiest rank's measured median."""


def decide(programs: dict[int, Any], cluster: Any, measured_compute_s: Sequence[float], optimizer: str, step: int,
           min_gain: float = DEFAULT_MIN_GAIN, noise: Sequence[float] = ()) -> RebalanceDecision:
    """The rows the measured speeds call for (module docstring, step 2), for ``programs`` (every rank's, of one
    data-parallel plan) running on ``cluster`` (the job's cluster; the plan's rank mapping is applied here).

    Raises:
        AdaptdistError: a measurement per rank missing or not positive.
        PlanInfeasibleError: the devices' memory holds no split (as the planner's).
    """
    from .device_placement import _coords, balanced_batch_rows
    from ..cost_models.estimate import estimate_programs
    from ..device_assignment import program_cluster

    ranks = sorted(programs)
    worst_noise = max((float(x) for x in noise), default=0.0)
    threshold = max(1.0 + min_gain, 1.0 + NOISE_SIGMAS * worst_noise)
    if len(measured_compute_s) != len(ranks) or not all(t > 0 for t in measured_compute_s):
        raise AdaptdistError(f"re-balance: need a positive compute time for each of {len(ranks)} ranks, got "
                             f"{list(measured_compute_s)}")
    plan = programs[ranks[0]].plan
    mesh = plan.mesh_spec
    pc = program_cluster(plan, cluster)
    est = estimate_programs(programs, pc, optimizer)
    predicted = tuple(float(est.ranks[r].compute_s) for r in ranks)
    scale = [m / p if p > 0 else 1.0 for m, p in zip(measured_compute_s, predicted)]
    axis = plan.batch_axis
    coords = [[r for r in ranks if mesh.coords(r)[mesh.index(axis)] == i] for i in range(mesh.size(axis))] \
        if axis is not None else []
    before = tuple(programs[mesh.rank(_coords(mesh, axis, i))].batch_slice[1] for i in range(len(coords)))

    def slowest(rows: Sequence[int]) -> float:
        worst = 0.0
        for i, members in enumerate(coords):
            for r in members:
                e = est.ranks[r]
                n0 = programs[r].batch_slice[1]
                per_row = max(float(e.compute_s) - float(e.optimizer_s), 0.0) / n0
                worst = max(worst, scale[r] * (float(e.optimizer_s) + per_row * rows[i]))
        return worst

    def kept(why: str, after: Sequence[int] = before) -> RebalanceDecision:
        return RebalanceDecision(step, before, before, tuple(measured_compute_s), predicted,
                                 slowest(before) if coords else max(measured_compute_s),
                                 slowest(after) if coords else max(measured_compute_s), False, why,
                                 worst_noise, threshold)

    if not coords or len(coords) < 2:
        return kept("the plan splits no batch axis")
    if any(n == 0 for n in before):
        return kept("a coordinate holds no rows: nothing to measure its speed from")
    rows = balanced_batch_rows(programs, pc, optimizer, time_scale=scale, estimate=est)
    if rows is None or tuple(rows) == before:
        return kept("the rows are already balanced for the measured speeds")
    gain = slowest(before) / slowest(rows)
    if gain < threshold:
        why = "the measurements' noise" if threshold > 1.0 + min_gain else f"{min_gain:.0%}"
        return kept(f"predicted gain {gain:.3f}x is under the {threshold:.3f}x threshold ({why})", rows)
    return RebalanceDecision(step, before, tuple(rows), tuple(measured_compute_s), predicted, slowest(before),
                             slowest(rows), True, "rows in proportion to the speeds measured in the run",
                             worst_noise, threshold)
