"""Predicted step time and peak memory of every rank's lowered program.

:func:`estimate_programs` costs exactly what :func:`~adaptdist.compiler.lowering.compile_model`
produced: for each rank it builds the program's :class:`~.schedule.StepSchedule`, prices every
compute node on that rank's device (:mod:`.compute`), every collective on the links between
its group's ranks (:mod:`.communication`), runs all ranks on the two-stream timeline
(:mod:`.overlap`, so a slow device makes its peers idle), adds the optimizer's step as
memory-bound work, and finds the peak memory by liveness (:mod:`.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import UsageError
from .communication import (LinkCost, collective_time_s, group_members, is_shm_priced, is_synchronous_collective,
                            link_cost)
from .compute import NodeCost, dispatches_op, flop_formulas, node_cost, node_time_s, roofline_time_s
from .hardware import ClusterLike, DeviceLike, as_cost_cluster, op_overhead_s
from .memory import MemoryEstimate, OptimizerModel, estimate_memory, optimizer_model
from .overlap import Compute, Event, Issue, Timeline, Wait, merge_computes, simulate
from .schedule import Ref, StepNode, StepSchedule, build_schedule


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of a rank's program: ``n_bytes`` is the full buffer (see :mod:`.communication`)."""

    name: str
    kind: str
    group: str
    group_size: Any
    n_bytes: Any
    time_s: Any
    tier: str
    calibrated: bool


@dataclass(frozen=True)
class RankEstimate:
    """One rank's predicted step.

    Attributes:
        rank: the rank. device: ``kind@host`` of its device.
        step_s: compute + idle, seconds. compute_s: its nodes' roofline times plus the optimizer step.
        communication_s: sum of its collectives' times (hidden or not). idle_s: compute stream waiting.
        optimizer_s: the optimizer step's share of ``compute_s``.
        flops: FLOPs of its program. memory: its :class:`~.memory.MemoryEstimate`.
        device_memory_bytes: the device's memory, for comparison.
        collectives: its collectives in program order.
    """

    rank: int
    device: str
    step_s: Any
    compute_s: Any
    communication_s: Any
    idle_s: Any
    optimizer_s: Any
    flops: Any
    memory: MemoryEstimate
    device_memory_bytes: int
    collectives: tuple[CollectiveCost, ...] = field(default=())


@dataclass(frozen=True)
class StepEstimate:
    """The predicted step of every rank; ``step_s`` is the slowest rank's (the job's step time)."""

    ranks: dict[int, RankEstimate]
    optimizer: str
    algorithm: str

    @property
    def step_s(self) -> float:
        return max(r.step_s for r in self.ranks.values())

    @property
    def peak_memory_bytes(self) -> int:
        return max(r.memory.peak_bytes for r in self.ranks.values())


def collective_bytes(schedule: StepSchedule, node: StepNode) -> Any:
    """Full buffer bytes of a collective node: all_reduce / reduce_scatter / all_to_all / broadcast: its
    input(s); all_gather: its output(s) (inputs and outputs summed over a coalesced collective)."""
    if node.collective == "all_gather":
        total: Any = 0
        for t in node.tensor_outputs():
            total = total + t.nbytes
        return total
    first = node.args[0]
    refs = first if isinstance(first, (list, tuple)) else [first]
    total = 0
    for ref in refs:
        if isinstance(ref, Ref):
            spec = schedule.spec(ref)
            for t in (spec if isinstance(spec, tuple) else (spec,)):
                if t is not None:
                    total = total + t.nbytes
    return total


def overlaps_communication(device: DeviceLike) -> bool:
    """Whether ``device`` runs collectives beside its computation (a GPU's communication stream) or, as a
    CPU rank on gloo does, on the cores it computes on (then a collective is waited for at once; see
    :mod:`.overlap`)."""
    return str(getattr(device, "kind", "cpu")) != "cpu"


def rank_events(schedule: StepSchedule, device: DeviceLike, collectives: Mapping[int, CollectiveCost],
                formulas: Mapping[Any, Callable], optimizer: OptimizerModel) -> tuple[list[Event], Any, Any]:
    """The timeline events of one rank's program (:mod:`.overlap`), its FLOPs, and its optimizer time.

    ``collectives`` maps a collective node's index to its cost. On a device that cannot overlap
    communication with computation (:func:`overlaps_communication`: CPU ranks) each collective is waited
    for right after its issue (:mod:`.overlap`). Every node that dispatches an op
    (:func:`~.compute.dispatches_op`) costs the device's ``op_overhead_s`` of compute-stream time: inside a
    compute node's time, as its own :class:`~.overlap.Compute` for a view op, before a collective's issue
    and after its wait. The optimizer step is a final :class:`~.overlap.Compute`: memory-bound
    ``optimizer.bytes_per_param_byte`` times the parameter bytes, plus ``optimizer.ops_per_param`` op
    overheads per parameter tensor.
    """
    events: list[Event] = []
    flops: Any = 0
    ovh = op_overhead_s(device)
    overlap = overlaps_communication(device)
    for n in schedule.nodes:
        if n.kind == "compute":
            c: NodeCost = node_cost(schedule, n, formulas)
            flops = flops + c.flops
            events.append(Compute(node_time_s(c, device)))
        elif n.kind == "collective":
            if ovh:
                events.append(Compute(ovh))
            events.append(Issue(n.index, n.group or "", collectives[n.index].time_s))
            if not overlap or is_synchronous_collective(n.target):  # shm ops: complete on return
                events.append(Wait(n.index))
        elif n.kind == "wait" and n.waits_on is not None:
            if overlap:
                events.append(Wait(n.waits_on))
            if ovh:
                events.append(Compute(ovh))
        elif ovh and dispatches_op(n):
            events.append(Compute(ovh))
    param_bytes: Any = 0
    for k in schedule.param_storages:
        param_bytes = param_bytes + schedule.storages[k].nbytes
    opt_s = roofline_time_s(0, optimizer.bytes_per_param_byte * param_bytes, 1.0,
                            float(device.memory_bandwidth_bytes_per_s))
    opt_s = opt_s + optimizer.ops_per_param * len(schedule.param_storages) * ovh
    events.append(Compute(opt_s))
    return merge_computes(events), flops, opt_s


def collective_costs(schedule: StepSchedule, cluster: ClusterLike, algorithm: str = "ring",
                     group_size: Callable[[StepNode], Any] | None = None,
                     links: Mapping[tuple[str, str], LinkCost] | None = None) -> dict[int, CollectiveCost]:
    """Cost of each collective node of ``schedule`` (node index -> :class:`CollectiveCost`).

    Args:
        group_size: node -> ranks in its group (default: from the schedule's mesh, :func:`group_members`).
        links: (group name, collective kind) -> :class:`LinkCost` to use (default: the cluster's links
            between the members).

    Raises:
        UsageError: a group name that is not a mesh axis; ClusterSpecError: bad link figures.
    """
    out = {}
    for n in schedule.nodes:
        if n.kind != "collective":
            continue
        members = group_members(n.group or "", schedule.rank, schedule.mesh)
        link = (links or {}).get((n.group or "", n.collective or "")) or link_cost(
            cluster, n.collective or "", members, shm=is_shm_priced(n.target))
        p = group_size(n) if group_size else len(members)
        nbytes = collective_bytes(schedule, n)
        t = collective_time_s(n.collective or "", nbytes, p, link.alpha_s, link.beta_s_per_byte, algorithm)
        out[n.index] = CollectiveCost(n.name, n.collective or "", n.group or "", p, nbytes, t, link.tier,
                                      link.calibrated)
    return out


def estimate_schedules(schedules: Mapping[int, StepSchedule], cluster: Any, optimizer: str = "adamw",
                       algorithm: str = "ring") -> StepEstimate:
    """:func:`estimate_programs` on already-built schedules (rank -> schedule).

    Raises:
        UsageError: unknown optimizer/algorithm, or a rank outside the cluster; ClusterSpecError: a
            device without a usable peak; CollectiveMismatchError: ranks issue different collectives.
    """
    cl = as_cost_cluster(cluster)
    if cl.world_size < len(schedules) or any(r >= cl.world_size for r in schedules):
        raise UsageError(f"the programs are for {len(schedules)} ranks but the cluster {cluster!r} has "
                         f"{cl.world_size}; describe at least as many devices")
    opt = optimizer_model(optimizer)
    formulas = flop_formulas()
    events, flops, opt_s, colls = {}, {}, {}, {}
    for r, s in schedules.items():
        colls[r] = collective_costs(s, cl, algorithm)
        events[r], flops[r], opt_s[r] = rank_events(s, cl.device(r), colls[r], formulas, opt)

    def members(rank: int, issue: Issue) -> Sequence[int]:
        return group_members(issue.group, rank, schedules[rank].mesh)

    timelines: dict[int, Timeline] = simulate(events, members)
    ranks = {}
    for r, s in schedules.items():
        dev = cl.device(r)
        t = timelines[r]
        ranks[r] = RankEstimate(r, f"{dev.kind}@{dev.host}", float(t.step_s), float(t.compute_s),
                                float(t.communication_s), float(t.idle_s), float(opt_s[r]), int(flops[r]),
                                estimate_memory(s, opt), int(dev.memory_bytes), tuple(colls[r].values()))
    return StepEstimate(ranks, opt.name, algorithm)


def estimate_programs(programs: Mapping[int, Any], cluster: Any, optimizer: str = "adamw",
                      algorithm: str = "ring") -> StepEstimate:
    """Predicted step time and peak memory of each rank's :class:`~adaptdist.program.RankProgram`.

    Args:
        programs: rank -> program, as :func:`~adaptdist.compiler.lowering.compile_model` returns.
        cluster: an :class:`adaptdist.cluster.Cluster` or any :class:`~.hardware.ClusterLike`.
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw`` (its state and step are costed).
        algorithm: collective algorithm, ``ring``, ``tree`` or ``auto`` (:mod:`.communication`).

    Returns:
        A :class:`StepEstimate` (seconds, bytes, FLOPs per rank).

    Raises:
        UsageError, ClusterSpecError, CollectiveMismatchError, UnsupportedOpError: see
        :func:`estimate_schedules` and :func:`~.schedule.build_schedule`.
    """
    return estimate_schedules({r: build_schedule(p) for r, p in sorted(programs.items())}, cluster, optimizer,
                              algorithm)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f}"


def estimate_table(est: StepEstimate, title: str = "predicted step per rank"):
    """A ``rich.table.Table``: per rank, device, step/compute/communication/idle (ms), GFLOP, and peak
    memory with its parts (MiB)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("rank", "device", "step ms", "compute ms", "comm ms", "idle ms", "GFLOP", "peak MiB",
                "params", "grads", "optim", "activ."):
        table.add_column(col, justify="left" if col in ("device",) else "right")
    for r, e in sorted(est.ranks.items()):
        m = e.memory
        table.add_row(str(r), e.device, _ms(e.step_s), _ms(e.compute_s), _ms(e.communication_s), _ms(e.idle_s),
                      f"{e.flops / 1e9:,.3f}", _mib(m.peak_bytes), _mib(m.params_bytes), _mib(m.grads_bytes),
                      _mib(m.optimizer_state_bytes + m.optimizer_temp_bytes), _mib(m.activations_bytes))
    return table


def collectives_summary(rank: RankEstimate) -> str:
    """``"3 x all_reduce (1.20 MiB, 0.95 ms, intra_host)"``, one entry per kind, for one rank."""
    kinds: dict[tuple[str, str], list[CollectiveCost]] = {}
    for c in rank.collectives:
        kinds.setdefault((c.kind, c.tier), []).append(c)
    parts = []
    for (kind, tier), cs in sorted(kinds.items()):
        nbytes = sum(float(c.n_bytes) for c in cs)
        t = sum(float(c.time_s) for c in cs)
        src = "calibrated" if all(c.calibrated for c in cs) else tier
        parts.append(f"{len(cs)} x {kind} ({_mib(nbytes)} MiB, {_ms(t)} ms, {src})")
    return ", ".join(parts) or "none"
