"""Where the cost model puts each part of an SPMD step on each rank: the predicted timeline that
``adaptdist train --trace`` draws beside the measured one.

:func:`predicted_segments` runs the same per-rank events and the same two-stream simulation as
:func:`~.estimate.estimate_programs` (:mod:`.overlap`), and records where each computation, each
collective (on its group's communication stream) and each wait falls, so the picture shows every collective
the estimate counts (an fsdp plan's all_gathers and reduce_scatters) with its predicted time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .communication import group_members
from .compute import flop_formulas
from .estimate import collective_costs, rank_events
from .hardware import as_cost_cluster
from .memory import optimizer_model
from .overlap import simulate
from .schedule import build_schedule


@dataclass(frozen=True)
class Segment:
    """One part of a rank's predicted step, seconds from the step's start: ``kind`` ``compute`` (forward and
    backward), ``optimizer``, ``wait`` (the compute stream idle until collective ``name`` finishes) or
    ``collective`` (``name`` the program's node, ``op`` its kind, ``group`` its process group, ``n_bytes``
    its full buffer)."""

    kind: str
    start_s: float
    end_s: float
    name: str = ""
    op: str = ""
    group: str = ""
    n_bytes: float = 0.0


def predicted_segments(programs: Mapping[int, Any], cluster: Any, optimizer: str = "adamw",
                       algorithm: str = "ring") -> dict[int, list[Segment]]:
    """Rank -> its predicted step as segments in time order (see :class:`Segment`), for the rank programs of
    :func:`~adaptdist.compiler.lowering.compile_model` on ``cluster``; the last ``optimizer_s`` of the last
    computation is the optimizer step. The collectives are exactly :attr:`~.estimate.RankEstimate.collectives`
    of :func:`~.estimate.estimate_programs` on the same arguments, with the same times.

    Raises:
        UsageError, ClusterSpecError, CollectiveMismatchError, UnsupportedOpError: as
            :func:`~.estimate.estimate_programs`.
    """
    schedules = {r: build_schedule(p) for r, p in sorted(programs.items())}
    cl = as_cost_cluster(cluster)
    opt = optimizer_model(optimizer)
    formulas = flop_formulas()
    events, opt_s, colls = {}, {}, {}
    for r, s in schedules.items():
        colls[r] = collective_costs(s, cl, algorithm)
        events[r], _, opt_s[r] = rank_events(s, cl.device(r), colls[r], formulas, opt)
    record: dict[int, list[tuple]] = {}
    simulate(events, lambda rank, issue: group_members(issue.group, rank, schedules[rank].mesh), record=record)
    out: dict[int, list[Segment]] = {}
    for r in schedules:
        segs: list[Segment] = []
        for item in record.get(r, []):
            kind, start, end = item[0], float(item[1]), float(item[2])
            if kind == "compute":
                segs.append(Segment("compute", start, end))
            else:
                c = colls[r][item[3]]
                segs.append(Segment(kind, start, end, c.name, c.kind, c.group,
                                    float(c.n_bytes) if kind == "collective" else 0.0))
        _split_optimizer(segs, float(opt_s[r]))
        out[r] = sorted(segs, key=lambda g: (g.start_s, g.kind != "compute"))
    return out


def _split_optimizer(segs: list[Segment], opt_s: float) -> None:
    """The optimizer is the tail of the last computation (rank_events appends it, merged with what precedes)."""
    last = max((i for i, g in enumerate(segs) if g.kind == "compute"), key=lambda i: segs[i].end_s, default=None)
    if last is None or opt_s <= 0:
        return
    g = segs[last]
    cut = max(g.start_s, g.end_s - opt_s)
    segs[last] = Segment("compute", g.start_s, cut)
    segs.append(Segment("optimizer", cut, g.end_s))
    if cut <= g.start_s:
        segs.pop(last)


def segments_as_tuples(segments: Mapping[int, Sequence[Segment]]) -> dict[int, list[tuple]]:
    """``{rank: [(kind, start_s, end_s, {name, op, group, bytes}), ...]}``: plain data for the trace view."""
    return {r: [(g.kind, g.start_s, g.end_s, {"name": g.name, "op": g.op, "group": g.group, "bytes": g.n_bytes}
                 if g.kind == "collective" else ({"collective": g.name} if g.kind == "wait" else {}))
                for g in segs] for r, segs in segments.items()}
