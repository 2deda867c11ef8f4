"""The inter-stage planner: pipeline stages over layer ranges and sub-meshes (Alpa's inter-operator pass).

Following Alpa (Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism for Distributed Deep
Learning", OSDI 2022, s.5), the step is a chain of layers (:mod:`.layers`) and the devices a row of ranks;
a pipeline of ``p`` stages gives stage ``i`` a contiguous layer range and a contiguous block of ranks
(its **sub-mesh**), and runs ``m`` microbatches.

1. **Stage cost** (:class:`StageCoster`): a layer range on a sub-mesh of ``k`` ranks is planned by the
   intra-stage pass -- the same per-axis ILP and mesh search as the whole-step planner
   (:func:`.search.solve_candidate` over :func:`.search.mesh_candidates` of ``k``), on the planning graph
   restricted to the range (:func:`sub_planning_graph`: the values it receives become batch-split inputs)
   -- and costed for the whole batch: compute and the intra-stage resharding (both scale with the batch),
   op dispatch overhead (paid once per microbatch), the gradient reduction over the stage's data-parallel
   ranks (once per step, after the flush), the state bytes per device and the activation bytes the backward
   keeps. One rank needs no ILP (everything whole on it). Costs are cached by (layer signatures of the
   range, the figures of its ranks), so repeated blocks are solved once; ``coster="analytic"`` costs a
   range from the layers' figures alone (replicated, or data-parallel with a ring all_reduce of its
   gradients), for speed and for tests.
2. **Sub-mesh shapes**, pruned as Alpa does: inside a host 1, 2, 4, ... ranks (and the whole host), else
   whole hosts; a block never straddles hosts unless it is whole hosts.
3. **The DP** (:func:`solve_stages`, Alpa's Algorithm 1): for each candidate ``t_max`` (every stage latency,
   ascending, merged within ``epsilon``), ``F(s, a, d)`` = the least sum of per-microbatch stage latencies
   that puts layers ``a..L-1`` on the last ``d`` ranks in ``s`` stages, each at most ``t_max`` and within
   its ranks' memory; the pipeline latency is ``min_s F(s, 0, D) + (m - 1) max_i t_i`` (Alpa's eq. 2), and
   the search stops once ``(m - 1) t_max`` alone exceeds the best. A stage's per-microbatch latency is
   ``F + B + W`` (with the executor's host time per microbatch,
   :data:`~adaptdist.cost_models.pipeline.EXECUTOR_MICROBATCH_HOST_S`) plus its sends (activations forward,
   gradients backward, over the link to the next/previous stage's first/last rank, the bytes split over its
   ranks) plus its gradient reduction amortized over the
   ``m`` microbatches. Memory: state + the activations of the microbatches the schedule keeps in flight
   (GPipe ``m``; 1F1B and ZB-H1 ``min(m, s)`` for the stage with ``s`` stages from it to the end).
4. **Schedule and microbatches**: for each ``m`` dividing the batch (``m >= p``; a stage whose batch axis has
   ``r`` ranks needs ``m r`` to divide it, so each replica's rows split evenly) and each memory rule, the
   DP's pipeline is costed under every schedule by :mod:`adaptdist.cost_models.pipeline` (GPipe, 1F1B,
   interleaved 1F1B, ZB-H1, with each stage's forward, input-gradient and weight-gradient times), plus the
   slowest stage's gradient reduction; the fastest that fits wins, ties (within :data:`TIE_TOLERANCE`) to
   the earlier schedule in :data:`~adaptdist.cost_models.pipeline.SCHEDULES`.
5. **Against SPMD**: :func:`plan_pipeline` takes the best non-pipeline plan's prediction
   (:func:`.search.plan_auto`'s) and marks the pipeline ``chosen`` only where it is predicted faster by
   more than :data:`TIE_TOLERANCE`.

Planner time: the DP is ``O(|T| * S * L^2 * D * K)`` for ``L`` layers, ``D`` ranks, ``K`` sub-mesh sizes,
``S <= min(D, m)`` stages and ``|T|`` latency candidates (at most ``L^2 D K``, fewer after merging); the
stage costs (``O(L^2 * K)`` ILP solves without repeated blocks, far fewer with) dominate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ...cost_models.communication import collective_time_s, link_cost
from ...cost_models.memory import optimizer_model
from ...cost_models.pipeline import (INTERLEAVE_CHUNKS, SCHEDULES, ScheduleEstimate, in_flight_microbatches,
                                      microbatch_times, schedule_estimate)
from ...errors import PlanInfeasibleError, UsageError
from ..capture import CapturedGraph
from .graph import PlanningGraph, build_planning_graph
from .layers import LayerGraph, build_layers

TIE_TOLERANCE = 0.01
"""A pipeline must be predicted faster than the best SPMD plan by more than this fraction to be chosen; schedules
within it of the fastest count as ties (the earlier in SCHEDULES wins)."""
MAX_MICROBATCHES = 64
"""The most microbatches the planner tries."""
EPSILON = 0.01
"""Stage latencies within this fraction of each other are one ``t_max`` candidate of the DP (Alpa's epsilon)."""
ILP_TIME_LIMIT_S = 10.0
"""Per intra-stage ILP solve."""


# --- value objects ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageEstimate:
    """One layer range on one sub-mesh, costed for a whole step (seconds, bytes per device).

    Attributes:
        compute_s: compute plus intra-stage resharding for the whole batch (scales with the batch).
        fractions: the forward, input-gradient and weight-gradient shares of ``compute_s``.
        overhead_s: op dispatch of one microbatch (paid by each). overhead_fractions: its F/B/W shares.
        grad_sync_s: the gradient reduction over the stage's ranks, once per step.
        state_bytes: parameters, gradients and optimizer state per device.
        activation_bytes: what the backward keeps for the whole batch, per device.
        mesh: the intra-stage mesh ((axis, size), ...). batch_axis: its batch axis or None.
        source: ``ilp``, ``single-rank`` or ``analytic``.
        param_placements: ``ilp`` only: ``(((layer offset in the range, index in its param_fqns), placements per
            mesh axis), ...)`` of the parameters the intra-stage planner shards (others replicated); by position, as
            like layers share one estimate (:func:`fqn_placements` names them for a range).
        fixed_s: (forward, input-gradient, weight-gradient) seconds per device of the memory traffic that does not
            shrink with the microbatch (:attr:`.layers.Layer.fixed_bytes` of the range over the slowest device's
            memory bandwidth, times the share of the weights each device computes with: split by the model axes
            that shard them, whole on the batch axis); ``compute_s`` counts it once per step (over the batch axis's
            replicas), each microbatch pays it whole.
        grad_add_s: one pass over the gradients each device computes (the same share of the range's trainable
            bytes) at that bandwidth: the executor adds each microbatch's gradients into the step's
            (:func:`~adaptdist.cost_models.pipeline.microbatch_times`).
        overlapped: the device overlaps arithmetic and memory traffic (a GPU: the roofline's max, else the sum;
            :func:`adaptdist.cost_models.compute.overlaps_compute_and_memory`).
    """

    compute_s: float
    fractions: tuple[float, float, float]
    overhead_s: float
    overhead_fractions: tuple[float, float, float]
    grad_sync_s: float
    state_bytes: float
    activation_bytes: float
    mesh: tuple[tuple[str, int], ...] = (("dp", 1),)
    batch_axis: str | None = "dp"
    source: str = "analytic"
    param_placements: tuple = ()
    fixed_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    grad_add_s: float = 0.0
    overlapped: bool = False

    def per_microbatch(self, m: int) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of one of ``m`` microbatches
        (:func:`~adaptdist.cost_models.pipeline.microbatch_times`): the compute's share, the traffic that does not
        shrink with the microbatch (:attr:`fixed_s`), the executor's gradient accumulation (:attr:`grad_add_s`),
        the op dispatch, and the pipeline executor's host time per microbatch
        (:data:`~adaptdist.cost_models.pipeline.EXECUTOR_MICROBATCH_HOST_S`, half on the forward, half on the
        input gradient)."""
        replicas = dict(self.mesh).get(self.batch_axis, 1) if self.batch_axis else 1
        return microbatch_times(self.compute_s, self.fractions, self.overhead_s, self.overhead_fractions, m,
                                self.fixed_s, self.grad_add_s, self.overlapped, replicas)

    def memory_bytes(self, in_flight: float, m: int) -> float:
        """Peak bytes per device with ``in_flight`` of ``m`` microbatches' activations held."""
        return self.state_bytes + in_flight * self.activation_bytes / m


@dataclass(frozen=True)
class StageChoice:
    """One stage of the chosen pipeline.

    Attributes:
        index: 0-based. layers: its layer names, in order. layer_range: ``(first, end)`` layer indices.
        ranks: its ranks (a contiguous block). mesh: intra-stage mesh ``{axis: size}``; batch_axis.
        forward_s, backward_s, weight_s: per microbatch, sends included, seconds.
        grad_sync_s: its gradient reduction per step. memory_bytes: peak per device under the schedule;
        capacity_bytes: the smallest memory among its ranks. source: how it was costed.
        param_placements: the intra-stage planner's sharded parameters (:attr:`StageEstimate.param_placements`).
    """

    index: int
    layers: tuple[str, ...]
    layer_range: tuple[int, int]
    ranks: tuple[int, ...]
    mesh: Mapping[str, int]
    batch_axis: str | None
    forward_s: float
    backward_s: float
    weight_s: float
    grad_sync_s: float
    memory_bytes: float
    capacity_bytes: float
    source: str
    param_placements: tuple = ()

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.weight_s


@dataclass(frozen=True)
class PipelineChoice:
    """The inter-stage planner's result (what a plan's pipeline field holds, see :meth:`to_dict`).

    Attributes:
        stages: the stages in pipeline order. schedule: one of ``SCHEDULES``. microbatches: ``m``.
        step_s: predicted step (the schedule's pipeline time + the slowest gradient reduction), seconds.
        bubble_s, bubble_fraction: the schedule's idle time on the slowest stage.
        schedules: every schedule weighed on this pipeline (``step_s`` inf where it cannot run, with why).
        spmd_step_s: the best non-pipeline plan's predicted step, or None when not compared.
        chosen: whether the pipeline is predicted faster than that plan (by more than TIE_TOLERANCE).
        layer_names: every layer, in order. planner_s: seconds the inter-stage search took.
        stage_costs: how many stage costs were computed (cache misses).
        chunks: interleaved 1F1B only: the model chunks in pipeline order (chunk ``j`` on stage ``j mod p``);
            each stage's ``layers`` are then its chunks' layers, and its ``layer_range`` its first chunk's.
        note: why a pipeline predicted faster is not the plan (empty otherwise).
    """

    stages: tuple[StageChoice, ...]
    schedule: str
    microbatches: int
    step_s: float
    bubble_s: float
    bubble_fraction: float
    schedules: tuple[ScheduleEstimate, ...] = ()
    spmd_step_s: float | None = None
    chosen: bool = True
    layer_names: tuple[str, ...] = ()
    planner_s: float = 0.0
    stage_costs: int = 0
    chunks: tuple[tuple[str, ...], ...] = ()
    note: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``num_stages``, ``schedule``, ``microbatches``, per stage its ``layers``, ``ranks``, ``mesh``
        and predicted seconds/bytes, and the prediction."""
        return {
            "num_stages": self.num_stages, "schedule": self.schedule, "microbatches": self.microbatches,
            "stages": [{"layers": list(s.layers), "ranks": list(s.ranks), "mesh": dict(s.mesh),
                        "batch_axis": s.batch_axis, "forward_s": s.forward_s, "backward_s": s.backward_s,
                        "weight_s": s.weight_s, "grad_sync_s": s.grad_sync_s, "memory_bytes": s.memory_bytes}
                       for s in self.stages],
            "predicted_step_s": self.step_s, "bubble_s": self.bubble_s, "bubble_fraction": self.bubble_fraction,
            "spmd_step_s": self.spmd_step_s, "chunks": [list(c) for c in self.chunks],
        }


# --- sub-meshes and the sub-cluster ------------------------------------------------------------------

class SubCluster:
    """``ranks`` of ``cluster`` as a cluster of their own (local rank ``i`` is ``ranks[i]``): what the
    intra-stage planner sees for one stage."""

    def __init__(self, cluster: Any, ranks: Sequence[int]) -> None:
        self._cluster = cluster
        self._ranks = tuple(ranks)
        self.calibrated = bool(getattr(cluster, "calibrated", True))
        self.shm_collectives = bool(getattr(cluster, "shm_collectives", False))  # --comm's costing view

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def device(self, rank: int) -> Any:
        return self._cluster.device(self._ranks[rank])

    def link(self, rank_a: int, rank_b: int) -> Any:
        return self._cluster.link(self._ranks[rank_a], self._ranks[rank_b])

    def collective_fit(self, collective: str, tier: str) -> Any:
        return self._cluster.collective_fit(collective, tier)

    def __repr__(self) -> str:
        return f"SubCluster(ranks {list(self._ranks)} of {self._cluster!r})"


def _hosts(cluster: Any) -> list[str]:
    return [cluster.device(r).host for r in range(cluster.world_size)]


def submesh_sizes(cluster: Any, offset: int, remaining: int) -> list[int]:
    """Sizes of the sub-meshes a stage starting at rank ``offset`` may take (module docstring, item 2), at most
    ``remaining`` ranks."""
    hosts = _hosts(cluster)
    world = len(hosts)
    out = []
    k = 1
    same = 1
    while offset + same < world and hosts[offset + same] == hosts[offset]:
        same += 1
    host_len = sum(1 for h in hosts if h == hosts[offset])
    while k <= min(same, remaining):
        out.append(k)
        k *= 2
    if same <= remaining and same not in out:
        out.append(same)
    at_host_start = offset == 0 or hosts[offset - 1] != hosts[offset]
    if at_host_start and same == host_len:  # whole hosts
        end = offset + same
        while end < world and end - offset < remaining:
            h = hosts[end]
            n = sum(1 for x in hosts[end:] if x == h)
            end += n
            if end - offset <= remaining:
                out.append(end - offset)
    return sorted(set(out))


# --- restricting the planning graph to a layer range ---------------------------------------------------

def device_times(pg: PlanningGraph, devices: Sequence[Any]) -> dict[str, tuple[float, float]]:
    """Each op node's (roofline seconds, op overhead seconds) on the slowest of ``devices``, as
    :func:`.graph.build_planning_graph` costs them on the whole cluster's slowest: a stage on faster devices
    computes faster (heterogeneous clusters)."""
    import torch

    from ...cost_models import compute as compute_cost
    from ...cost_models.hardware import op_overhead_s
    from ...passes.sharding_rules import tensor_args
    from .graph import _flops, _is_view, _outputs

    formulas = compute_cost.flop_formulas()
    out = {}
    for name, pn in pg.nodes.items():
        if pn.kind != "op":
            continue
        node = pg.fx_nodes[name]
        nbytes, _, dtype = _outputs(node.meta.get("val"))
        moved = 0 if _is_view(node) else sum(int(a.meta["val"].numel() * a.meta["val"].element_size())
                                             for _, a in tensor_args(node)
                                             if isinstance(a.meta.get("val"), torch.Tensor)) + sum(nbytes)
        cost = compute_cost.NodeCost(name, _flops(node, formulas), moved, dtype)
        out[name] = (max(float(compute_cost.node_time_s(cost, d)) - op_overhead_s(d) for d in devices),
                     max(op_overhead_s(d) for d in devices))
    return out


def sub_planning_graph(lg: LayerGraph, first: int, end: int,
                       times: Mapping[str, tuple[float, float]] | None = None) -> PlanningGraph:
    """``lg``'s planning graph restricted to layers ``first..end-1``: their ops, the parameters, buffers and batch
    inputs they read, and every value they receive from another stage as a batch-split input (dim 0 a
    multiple of the batch); a small value that is not (a scalar) is recomputed inside, with what it needs.
    ``times`` (:func:`device_times`) re-costs the ops on the stage's devices.

    Raises:
        InternalError: a received value cannot be split like the batch and is too large to recompute.
    """
    from ...errors import InternalError

    pg = lg.pg
    inside = {n for n, li in lg.layer_of.items() if first <= li < end and pg.nodes[n].kind == "op"}
    resolve = {n: a[0] for n, a in pg.aliases.items()}
    boundary: set[str] = set()
    placeholders: set[str] = set()
    todo = list(inside)
    pulled = 0
    while todo:
        n = todo.pop()
        for a in pg.fx_nodes[n].all_input_nodes:
            s = resolve.get(a.name, a.name)
            if s not in pg.nodes or s in inside or s in boundary:
                continue
            pn = pg.nodes[s]
            if pn.kind != "op":
                placeholders.add(s)
                continue
            shape = pn.out_shapes[0] if pn.out_shapes else ()
            if shape and pg.batch_size > 0 and shape[0] % pg.batch_size == 0 and shape[0] > 0:
                boundary.add(s)
                continue
            pulled += 1
            if pulled > 256 and sum(pn.out_bytes) > 4096:
                raise InternalError(f"stage of layers {first}..{end - 1}: the received value {s!r} (shape "
                                    f"{list(shape)}) is not split like the batch and too large to recompute")
            inside.add(s)
            todo.append(s)
    keep = inside | boundary | placeholders
    nodes = {}
    for n in keep:
        pn = pg.nodes[n]
        if n in boundary:
            nodes[n] = dataclasses.replace(pn, kind="batch", roof_s=0.0, overhead_s=0.0)
        elif times is not None and n in times:
            nodes[n] = dataclasses.replace(pn, roof_s=times[n][0], overhead_s=times[n][1])
        else:
            nodes[n] = dataclasses.replace(pn)
    order = [n for n in pg.order if n in nodes or (n in pg.aliases and pg.aliases[n][0] in nodes)]
    aliases = {n: a for n, a in pg.aliases.items() if a[0] in nodes}
    edges = [e for e in pg.edges if e.src in nodes and e.dst in inside]
    loss = pg.loss if pg.loss and pg.loss[0] in inside else None
    grad_of = {p: s for p, s in pg.grad_of.items() if p in nodes and s[0] in inside}
    sub = PlanningGraph(pg.gm, nodes, order, edges, aliases, loss,
                        [o for o in pg.replicated_outputs if o[0] in inside], grad_of, [], pg.batch_size,
                        pg.fx_nodes, [o for o in pg.per_rank_outputs if o[0] in inside])
    sub.peak_steps = _peak_steps(sub, len(pg.order))
    return sub


def _peak_steps(pg: PlanningGraph, n: int, count: int = 3) -> list[int]:
    """The ``count`` schedule steps (of the whole step's ``n``) where ``pg``'s non-state nodes hold the most."""
    curve = _activation_curve(pg, n)
    return sorted(i for _, i in sorted(((v, i) for i, v in enumerate(curve)), key=lambda t: (-t[0], t[1]))[:count])


def _activation_curve(pg: PlanningGraph, n: int) -> list[float]:
    delta = [0.0] * (n + 2)
    for pn in pg.nodes.values():
        if pn.kind in ("param", "buffer", "batch") or pn.live[1] < pn.live[0]:
            continue
        delta[pn.live[0]] += sum(pn.out_bytes)
        delta[min(pn.live[1], n) + 1] -= sum(pn.out_bytes)
    total, curve = 0.0, []
    for i in range(n):
        total += delta[i]
        curve.append(total)
    return curve


# --- stage costs -------------------------------------------------------------------------------------

def _split(lg: LayerGraph, first: int, end: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """F/B/W shares of the range's compute and of its op count."""
    ls = lg.layers[first:end]
    c = [sum(x.forward_s for x in ls), sum(x.backward_s for x in ls), sum(x.weight_s for x in ls)]
    o = [sum(x.ops[i] for x in ls) for i in range(3)]
    tc, to = sum(c) or 1.0, sum(o) or 1
    return (c[0] / tc, c[1] / tc, c[2] / tc), (o[0] / to, o[1] / to, o[2] / to)


class StageCoster:
    """Costs of layer ranges on sub-meshes (module docstring, item 1), cached.

    Args:
        lg: the layers. cluster: the whole cluster. optimizer: sizes the optimizer state.
        mode: ``ilp`` (the intra-stage planner) or ``analytic``.
        time_limit_s: per ILP solve.
    """

    def __init__(self, lg: LayerGraph, cluster: Any, optimizer: str = "adamw", mode: str = "ilp",
                 time_limit_s: float = ILP_TIME_LIMIT_S, mesh: Any = None, dp_only: bool = False) -> None:
        if mode not in ("ilp", "analytic"):
            raise UsageError(f"stage coster {mode!r} is not one of ilp, analytic")
        self.lg, self.cluster, self.mode, self.time_limit_s = lg, cluster, mode, time_limit_s
        self.mesh = mesh  # a fixed intra-stage MeshCandidate for multi-rank stages (None: search every shape)
        self.dp_only = dp_only  # multi-rank stages data parallel (stages of different sizes: the lowering's rule)
        self.state_copies = optimizer_model(optimizer).state_copies
        self.cache: dict[tuple, StageEstimate | None] = {}
        self.strategy_cache: dict = {}
        self.times_cache: dict = {}
        self.misses = 0
        self.fallbacks: list[str] = []

    def _key(self, first: int, end: int, ranks: Sequence[int]) -> tuple:
        sigs = tuple(layer.signature for layer in self.lg.layers[first:end])
        devs = tuple((d.kind, tuple(sorted(d.peak_flops.items())), d.memory_bandwidth_bytes_per_s,
                      getattr(d, "op_overhead_s", None)) for d in (self.cluster.device(r) for r in ranks))
        hosts = _hosts(self.cluster)
        shape = tuple(hosts[r] == hosts[ranks[0]] for r in ranks)
        return sigs, first == 0, end == len(self.lg.layers), devs, shape

    def __call__(self, first: int, end: int, ranks: Sequence[int]) -> StageEstimate | None:
        """The cost of layers ``first..end-1`` on ``ranks`` (None: the intra-stage planner found no plan)."""
        key = self._key(first, end, ranks)
        if key not in self.cache:
            self.misses += 1
            self.cache[key] = self._compute(first, end, tuple(ranks))
        return self.cache[key]

    def _state_bytes(self, sub: PlanningGraph, divisor: Callable[[str], float] = lambda n: 1.0) -> float:
        total = 0.0
        for p in sub.params():
            copies = 1 + (self.state_copies + 1 if p.kind == "param" and p.name in sub.grad_of else 0)
            total += copies * sum(p.out_bytes) / divisor(p.name)
        return total

    def _times(self, ranks: tuple[int, ...]) -> dict[str, tuple[float, float]] | None:
        """Op times on these ranks' slowest device, or None where they are the cluster's slowest (the planning
        graph's own)."""
        sig = lambda d: (d.kind, tuple(sorted(d.peak_flops.items())), d.memory_bandwidth_bytes_per_s,  # noqa: E731
                         getattr(d, "op_overhead_s", None))
        everyone = {sig(self.cluster.device(r)): self.cluster.device(r) for r in range(self.cluster.world_size)}
        mine = {sig(self.cluster.device(r)): self.cluster.device(r) for r in ranks}
        if len(everyone) == 1:
            return None
        key = tuple(sorted(mine, key=repr))
        if key not in self.times_cache:
            self.times_cache[key] = device_times(self.lg.pg, list(mine.values()))
        return self.times_cache[key]

    def _compute(self, first: int, end: int, ranks: tuple[int, ...]) -> StageEstimate | None:
        est = self._estimate(first, end, ranks)
        return None if est is None else self._with_traffic(est, first, end, ranks)

    def _with_traffic(self, est: StageEstimate, first: int, end: int, ranks: tuple[int, ...]) -> StageEstimate:
        """``est`` with its per-microbatch traffic (:attr:`StageEstimate.fixed_s`, ``grad_add_s``, ``overlapped``)
        on the slowest memory among ``ranks``."""
        from ...cost_models.compute import overlaps_compute_and_memory
        from ...placement import Shard

        dev = min((self.cluster.device(r) for r in ranks), key=lambda d: d.memory_bandwidth_bytes_per_s)
        bw = float(dev.memory_bandwidth_bytes_per_s)
        layers = self.lg.layers[first:end]
        trainable = {p.fqn: float(sum(p.out_bytes)) for p in self.lg.pg.params()
                     if p.name in self.lg.pg.grad_of and p.fqn is not None}
        mine = {f: trainable[f] for L in layers for f in L.param_fqns if f in trainable}
        total = sum(mine.values())
        held = total
        for fqn, pls in fqn_placements(self.lg, first, est.param_placements):
            if fqn in mine:  # split by the model axes that shard it (the batch axis's shards are gathered to use)
                d = math.prod(k for (a, k), p in zip(est.mesh, pls) if a != est.batch_axis and isinstance(p, Shard))
                held -= mine[fqn] * (1.0 - 1.0 / d)
        share = held / total if total > 0 else 1.0
        if bw <= 0:
            return est
        fixed = tuple(share * sum(L.fixed_bytes[x] for L in layers) / bw for x in range(3))
        return dataclasses.replace(est, fixed_s=fixed, grad_add_s=held / bw,  # type: ignore[arg-type]
                                   overlapped=overlaps_compute_and_memory(dev))

    def _estimate(self, first: int, end: int, ranks: tuple[int, ...]) -> StageEstimate | None:
        fr, of = _split(self.lg, first, end)
        sub = sub_planning_graph(self.lg, first, end, self._times(ranks))
        ops = [pn for pn in sub.nodes.values() if pn.kind == "op"]
        roof = sum(pn.roof_s for pn in ops)
        overhead = sum(pn.overhead_s for pn in ops)
        acts = max(_activation_curve(sub, len(self.lg.pg.order)), default=0.0)
        if len(ranks) == 1:
            return StageEstimate(roof, fr, overhead, of, 0.0, self._state_bytes(sub), acts, (("dp", 1),), "dp",
                                 "single-rank")
        if self.mode == "analytic":
            return self._analytic(sub, roof, overhead, acts, fr, of, ranks)
        try:
            return self._ilp(sub, fr, of, ranks, acts, first, end)
        except Exception as e:  # noqa: BLE001 -- a range the intra-stage planner cannot take is costed analytically
            self.fallbacks.append(f"layers {first}..{end - 1} on ranks {list(ranks)}: {type(e).__name__}: {e}")
            return self._analytic(sub, roof, overhead, acts, fr, of, ranks)

    def _analytic(self, sub: PlanningGraph, roof: float, overhead: float, acts: float, fr, of,
                  ranks: tuple[int, ...]) -> StageEstimate:
        k = len(ranks)
        link = link_cost(self.cluster, "all_reduce", list(ranks))
        grads = sum(sum(sub.nodes[p].out_bytes) for p in sub.grad_of)
        sync = float(collective_time_s("all_reduce", grads, k, link.alpha_s, link.beta_s_per_byte)) if grads else 0.0
        return StageEstimate(roof / k, fr, overhead, of, sync, self._state_bytes(sub), acts / k, (("dp", k),), "dp",
                             "analytic")

    def solve_on(self, sub: PlanningGraph, c: Any, cl: SubCluster) -> tuple | None:
        """The intra-stage ILP of ``sub`` on mesh candidate ``c`` over ``cl``: :func:`.search.solve_candidate`'s
        ``(evaluation, axis solutions, chosen strategies)``, or None where it has no solution. Within the device's
        memory with the whole batch's activations (more than any schedule keeps), so the ILP shards state where
        memory is tight; where even that does not fit, without the limit (the DP checks the stage's memory with
        the schedule's in-flight activations). ``adaptdist explain`` re-solves a chosen stage with it."""
        from .ilp import Infeasible
        from .problem import Constraints
        from .search import solve_candidate

        device_bytes = float(min(cl.device(i).memory_bytes for i in range(cl.world_size)))
        for capacity in (device_bytes, 1e6 * device_bytes):
            try:
                return solve_candidate(sub, c, cl, Constraints(), self.state_copies, capacity, self.strategy_cache,
                                       self.time_limit_s)
            except Infeasible:
                continue
        return None

    def _ilp(self, sub: PlanningGraph, fr, of, ranks: tuple[int, ...], acts: float, first: int = 0,
             end: int = 0) -> StageEstimate | None:
        from .problem import _out, factors, reshard_time_s, GRADIENT_BUCKETS, OtherAxis
        from .search import _axis_order, mesh_candidates
        from ...placement import Shard

        cl = SubCluster(self.cluster, ranks)
        best = None
        shapes = [self.mesh] if self.mesh is not None else mesh_candidates(len(ranks), sub.batch_size)
        if self.dp_only:
            from .search import BATCH_AXIS, MeshCandidate
            from ...mesh import Mesh

            shapes = [MeshCandidate(Mesh.one_axis(BATCH_AXIS, len(ranks)), BATCH_AXIS)]
        for c in shapes:
            if c.mesh.world_size != len(ranks):
                return None
            solved = self.solve_on(sub, c, cl)
            if solved is None:
                continue
            ev, sols, chosen = solved
            axes = _axis_order(c)
            sync = 0.0
            for a in axes:
                prob = sols[a].problem
                others = [OtherAxis(b, c.mesh.size(b), chosen[b]) for b in axes if b != a]
                _, fb, _ = factors(sub, others)
                t = 0.0
                for p, (src, idx) in sub.grad_of.items():
                    g, q = _out(chosen[a].get(src), idx), _out(chosen[a].get(p), 0)
                    nbytes = sub.nodes[src].out_bytes[idx] / fb[(src, idx)]
                    t += reshard_time_s(g, q, nbytes, c.mesh.size(a), prob.alpha_s, prob.beta_s_per_byte,
                                        GRADIENT_BUCKETS, prob.links)
                sync += t + (prob.alpha_s if t > 0 else 0.0)
            comm = sum(ev.communication_s.values())
            sync = min(sync, comm)

            def divisor(name: str) -> float:
                d = 1.0
                for a in axes:
                    if isinstance(_out(chosen[a].get(name), 0), Shard):
                        d *= c.mesh.size(a)
                return d

            state = self._state_bytes(sub, divisor)
            split = c.mesh.size(c.batch_axis) if c.batch_axis else 1

            def place(name: str, a: str) -> Any:
                return _out(chosen[a].get(name), 0)

            pos = {f: (i - first, k) for i in range(first, end) for k, f in enumerate(self.lg.layers[i].param_fqns)}
            pls = tuple(sorted((pos[pn.fqn], tuple(place(pn.name, a) for a in c.mesh.names)) for pn in sub.params()
                               if pn.kind == "param" and getattr(pn, "fqn", None) in pos
                               and any(isinstance(place(pn.name, a), Shard) for a in c.mesh.names)))
            est = StageEstimate(ev.compute_s + comm - sync, fr, ev.overhead_s, of, sync, state, acts / split,
                                tuple(c.mesh.as_dict().items()), c.batch_axis, "ilp", pls)
            total = est.compute_s + est.overhead_s + est.grad_sync_s
            if best is None or total < best[0] * (1 - 1e-9):
                best = (total, est)
        return best[1] if best else None


def fqn_placements(lg: LayerGraph, first: int, placements: tuple) -> tuple:
    """A :attr:`StageEstimate.param_placements` (by position) for the range starting at layer ``first``, by fqn:
    ``((fqn, placements per mesh axis), ...)``."""
    return tuple((lg.layers[first + i].param_fqns[k], pl) for (i, k), pl in placements)


# --- the DP ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSlot:
    """A stage as the DP sees it: layers ``first..end-1`` on ranks ``offset..offset+size-1``."""

    first: int
    end: int
    offset: int
    size: int


@dataclass
class DPResult:
    """The DP's best pipeline for one ``m`` and memory rule: its Alpa latency and stages."""

    latency_s: float
    slots: list[StageSlot]
    times_s: list[float]
    t_max_tried: int = 0


def solve_stages(num_layers: int, num_devices: int, latency_s: Callable[[StageSlot], float | None],
                 memory_ok: Callable[[StageSlot, int], bool], sizes: Callable[[int, int], Sequence[int]],
                 microbatches: int, min_stages: int = 2, max_stages: int | None = None,
                 epsilon: float = EPSILON) -> DPResult | None:
    """Alpa's inter-operator DP (module docstring, item 3).

    Args:
        latency_s: a slot's per-microbatch latency, seconds (None: the slot cannot run).
        memory_ok: ``(slot, s)`` -> whether the slot fits when ``s`` stages run from it to the end (it
            included: what 1F1B's in-flight count depends on).
        sizes: ``(offset, remaining ranks)`` -> the sub-mesh sizes a stage starting at ``offset`` may take.
        microbatches: ``m``; stages are at most ``m`` (and ``max_stages``), at least ``min_stages``.
        epsilon: latencies within this fraction are one ``t_max`` candidate (0: every distinct one; exact).

    Returns:
        The pipeline of least ``sum t_i + (m - 1) max t_i`` using every device, or None when none fits.
    """
    L, D, m = num_layers, num_devices, microbatches
    S = min(D, m, L, max_stages or D)
    if S < min_stages:
        return None
    lat: dict[StageSlot, float] = {}
    for off in range(D):
        for k in sizes(off, D - off):
            for a in range(L):
                for b in range(a + 1, L + 1):
                    if (off == 0) != (a == 0) or (off + k == D) != (b == L) or (off == 0 and k == D and min_stages > 1):
                        continue  # a slot no pipeline using every rank and every layer can hold
                    if min(L - b, D - off - k) < 0 or (off + k < D and L - b < 1):
                        continue
                    slot = StageSlot(a, b, off, k)
                    t = latency_s(slot)
                    if t is not None and math.isfinite(t):
                        lat[slot] = t
    cands = sorted(set(lat.values()))
    if epsilon > 0:
        merged: list[float] = []
        for t in cands:
            if merged and t <= merged[-1] * (1 + epsilon):
                merged[-1] = t  # the bucket's largest, so every member passes
            else:
                merged.append(t)
        cands = merged
    slots_list = list(lat)
    by_start: dict[tuple[int, int], list[tuple[float, int, int, int]]] = {}  # (t, end, size, slot index), by t
    for idx, slot in enumerate(slots_list):
        by_start.setdefault((slot.first, slot.offset), []).append((lat[slot], slot.end, slot.size, idx))
    for v in by_start.values():
        v.sort()
    fits: dict[tuple[int, int], bool] = {}  # (slot index, stages from it) -> memory_ok, asked once
    best: DPResult | None = None
    tried = 0
    inf = float("inf")
    for t_max in cands:
        if best is not None and (m - 1) * t_max >= best.latency_s:
            break
        tried += 1
        # F[s][a][d]: least sum placing layers a.. on the last d devices in s stages
        F = [[[inf] * (D + 1) for _ in range(L + 1)] for _ in range(S + 1)]
        arg: dict[tuple[int, int, int], StageSlot] = {}
        F[0][L][0] = 0.0
        for s in range(1, S + 1):
            prev = F[s - 1]
            for a in range(L - 1, -1, -1):
                row = F[s][a]
                for d in range(1, D + 1):
                    bestv, pick = inf, -1
                    for t, end, size, idx in by_start.get((a, D - d), ()):
                        if t > t_max:
                            break
                        if size > d:
                            continue
                        rest = prev[end][d - size]
                        if rest == inf or t + rest >= bestv:
                            continue
                        ok = fits.get((idx, s))
                        if ok is None:
                            ok = fits[(idx, s)] = bool(memory_ok(slots_list[idx], s))
                        if not ok:
                            continue
                        bestv, pick = t + rest, idx
                    row[d] = bestv
                    if pick >= 0:
                        arg[(s, a, d)] = slots_list[pick]
        for s in range(min_stages, S + 1):
            if F[s][0][D] == inf:
                continue
            slots, a, d = [], 0, D
            for r in range(s, 0, -1):
                slot = arg[(r, a, d)]
                slots.append(slot)
                a, d = slot.end, d - slot.size
            times = [lat[x] for x in slots]
            total = sum(times) + (m - 1) * max(times)
            if best is None or total < best.latency_s * (1 - 1e-12):
                best = DPResult(total, slots, times)
    if best is not None:
        best.t_max_tried = tried
    return best


def brute_force_stages(num_layers: int, num_devices: int, latency_s: Callable[[StageSlot], float | None],
                       memory_ok: Callable[[StageSlot, int], bool], sizes: Callable[[int, int], Sequence[int]],
                       microbatches: int, min_stages: int = 2) -> float | None:
    """Every partition of the layers and every sub-mesh assignment, for tests of :func:`solve_stages`: the least
    ``sum t_i + (m - 1) max t_i``."""
    best = None

    def rec(a: int, off: int, acc: list[tuple[StageSlot, float]]) -> None:
        nonlocal best
        if a == num_layers and off == num_devices:
            s = len(acc)
            if s < min_stages or s > microbatches:
                return
            if not all(memory_ok(slot, s - i) for i, (slot, _) in enumerate(acc)):
                return
            ts = [t for _, t in acc]
            v = sum(ts) + (microbatches - 1) * max(ts)
            best = v if best is None or v < best else best
            return
        if a == num_layers or off == num_devices:
            return
        for k in sizes(off, num_devices - off):
            for b in range(a + 1, num_layers + 1):
                slot = StageSlot(a, b, off, k)
                t = latency_s(slot)
                if t is None:
                    continue
                rec(b, off + k, acc + [(slot, t)])

    rec(0, 0, [])
    return best


# --- the planner ----------------------------------------------------------------------------------------

def _send_s(cluster: Any, src: int, dst: int, nbytes: float) -> float:
    if nbytes <= 0:
        return 0.0
    link = link_cost(cluster, "send_recv", [src, dst])
    return float(collective_time_s("send_recv", nbytes, 2, link.alpha_s, link.beta_s_per_byte))


def microbatch_candidates(batch_size: int, limit: int = MAX_MICROBATCHES) -> list[int]:
    """Microbatch counts the planner tries: the divisors of the batch from 2 to ``limit``."""
    return [m for m in range(2, min(batch_size, limit) + 1) if batch_size % m == 0]


def _memory_error(lg: LayerGraph, coster: Callable, cluster: Any, sizes: Callable) -> PlanInfeasibleError:
    """Name the device and the layer that does not fit even alone on the largest sub-mesh, else the smallest device."""
    world = cluster.world_size
    dev = min((cluster.device(r) for r in range(world)), key=lambda d: d.memory_bytes)
    worst = None
    for i, layer in enumerate(lg.layers):
        need = None
        for k in sizes(0, world):
            est = coster(i, i + 1, tuple(range(k)))
            if est is not None:
                v = est.state_bytes + est.activation_bytes
                need = v if need is None else min(need, v)
        if need is not None and (worst is None or need > worst[1]):
            worst = (layer.name, need)
    what = (f"layer {worst[0]} alone needs {_size(worst[1])} per device (its parameters, gradients, optimizer "
            f"state and one microbatch's activations)" if worst else "no stage fits")
    return PlanInfeasibleError(
        f"no pipeline fits device memory: rank {dev.rank} ({dev.kind} on {dev.host}) holds {_size(dev.memory_bytes)}; "
        f"{what}. Try more devices, more microbatches, a smaller --batch-size, or an optimizer with less state "
        "(--optimizer sgd).")


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def plan_stages(lg: LayerGraph, cluster: Any, coster: Callable[[int, int, Sequence[int]], StageEstimate | None], *,
                microbatches: Sequence[int] | None = None, schedules: Sequence[str] = SCHEDULES,
                num_stages: int | None = None, spmd_step_s: float | None = None,
                epsilon: float = EPSILON, sizes: Callable[[int, int], Sequence[int]] | None = None) -> PipelineChoice:
    """The inter-stage search (module docstring, items 3-5) over ``lg``'s layers and ``cluster``'s ranks.

    Args:
        coster: ``(first, end, ranks)`` -> the range's :class:`StageEstimate` (a :class:`StageCoster`).
        microbatches: the counts to try (default :func:`microbatch_candidates` of the batch).
        schedules: the schedules to weigh (default all). num_stages: a fixed number of stages.
        spmd_step_s: the best non-pipeline plan's predicted step, to compare against.
        sizes: ``(offset, remaining ranks)`` -> the sub-mesh sizes a stage may take (default
            :func:`submesh_sizes`).

    Raises:
        PlanInfeasibleError: no pipeline fits the memory (names the smallest device and the layer that does
            not fit), or fewer than 2 ranks/layers/microbatches.
        UsageError: an unknown schedule.
    """
    t0 = time.perf_counter()
    for s in schedules:
        if s not in SCHEDULES:
            raise UsageError(f"schedule {s!r} is not one of {', '.join(SCHEDULES)}")
    L, D = len(lg.layers), cluster.world_size
    if D < 2 or L < 2:
        raise PlanInfeasibleError(f"a pipeline needs at least 2 ranks and 2 layers; this step has {L} layer(s) "
                                  f"({', '.join(lg.names)}) on {D} rank(s)")
    ms = list(microbatches) if microbatches else microbatch_candidates(lg.pg.batch_size)
    if not ms:
        raise PlanInfeasibleError(f"a pipeline needs at least 2 microbatches; the batch has {lg.pg.batch_size} rows")

    if sizes is None:
        def sizes(off: int, remaining: int) -> list[int]:
            return submesh_sizes(cluster, off, remaining)

    caps = {}

    def capacity(slot: StageSlot) -> float:
        key = (slot.offset, slot.size)
        if key not in caps:
            caps[key] = float(min(cluster.device(r).memory_bytes for r in range(slot.offset, slot.offset + slot.size)))
        return caps[key]

    def est(slot: StageSlot) -> StageEstimate | None:
        return coster(slot.first, slot.end, tuple(range(slot.offset, slot.offset + slot.size)))

    def fbw(slot: StageSlot, m: int) -> tuple[float, float, float] | None:
        e = est(slot)
        if e is None:
            return None
        f, b, w = e.per_microbatch(m)
        if slot.end < L and slot.offset + slot.size < D:
            f += _send_s(cluster, slot.offset + slot.size - 1, slot.offset + slot.size,
                         lg.forward_bytes[slot.end - 1] / m / slot.size)
        if slot.first > 0 and slot.offset > 0:
            b += _send_s(cluster, slot.offset, slot.offset - 1, lg.backward_bytes[slot.first - 1] / m / slot.size)
        return f, b, w

    found: list[tuple[float, PipelineChoice]] = []
    wanted_rules = {("gpipe" if s == "gpipe" else "1f1b") for s in schedules}
    for m in ms:
        for rule in sorted(wanted_rules):
            def latency(slot: StageSlot, m=m) -> float | None:
                e = est(slot)
                if e is None:
                    return None
                replicas = dict(e.mesh).get(e.batch_axis, 1) if e.batch_axis else 1
                if lg.pg.batch_size % (m * replicas):  # each replica's rows split into m equal microbatches
                    return None
                t = fbw(slot, m)
                return sum(t) + e.grad_sync_s / m  # type: ignore[arg-type]

            def memory_ok(slot: StageSlot, s: int, m=m, rule=rule) -> bool:
                e = est(slot)
                flight = m if rule == "gpipe" else min(m, s)
                return e is not None and e.memory_bytes(flight, m) <= capacity(slot)

            res = solve_stages(L, D, latency, memory_ok, sizes, m, max_stages=num_stages or None,
                               min_stages=num_stages or 2, epsilon=epsilon)
            if res is None:
                continue
            found.extend(_schedule_choices(lg, res, m, rule, schedules, est, fbw, capacity, cluster))
    if not found:
        m = max(ms)
        shaped = solve_stages(L, D, lambda slot: 0.0 if est(slot) is not None else None, lambda slot, s: True, sizes,
                              m, max_stages=num_stages or None, min_stages=num_stages or 2)
        if shaped is None:  # not memory: no pipeline of these sub-meshes uses every rank
            raise PlanInfeasibleError(
                f"no pipeline of {L} layers ({', '.join(lg.names)}) uses all {D} ranks with at most {m} microbatches "
                f"(a schedule needs at least as many microbatches as stages, every stage a layer"
                + (f", {num_stages} stages" if num_stages else "") + "); try a larger batch or fewer ranks")
        raise _memory_error(lg, coster, cluster, sizes)
    fastest = min(t for t, _ in found)
    order = {s: i for i, s in enumerate(SCHEDULES)}
    pick = min((c for t, c in found if t <= fastest * (1 + TIE_TOLERANCE)),
               key=lambda c: (order[c.schedule], c.step_s))
    chosen = spmd_step_s is None or pick.step_s < spmd_step_s * (1 - TIE_TOLERANCE)
    return dataclasses.replace(pick, spmd_step_s=spmd_step_s, chosen=chosen, layer_names=tuple(lg.names),
                               planner_s=time.perf_counter() - t0,
                               stage_costs=getattr(coster, "misses", 0))


def _schedule_choices(lg: LayerGraph, res: DPResult, m: int, rule: str, schedules: Sequence[str], est, fbw, capacity,
                      cluster: Any) -> list[tuple[float, PipelineChoice]]:
    p = len(res.slots)
    times = [fbw(s, m) for s in res.slots]
    fs, bs, ws = [t[0] for t in times], [t[1] for t in times], [t[2] for t in times]
    ests = [est(s) for s in res.slots]
    sync = max(e.grad_sync_s for e in ests)
    nlayers = [s.end - s.first for s in res.slots]
    weighed = []
    layouts: dict[str, tuple] = {}
    order = [x for x in schedules if x != "interleaved-1f1b"] + [x for x in schedules if x == "interleaved-1f1b"]
    for sched in order:
        if (sched == "gpipe") != (rule == "gpipe"):
            continue
        if sched == "interleaved-1f1b":
            # its chunks are new ranges to cost (intra-stage ILPs): only where a balanced estimate could win,
            # m * t + (p - 1) t / v with t the mean stage time (Narayanan et al. 2021's bubble)
            mean = sum(sum(t) for t in times) / p
            guess = (m + (p - 1) / INTERLEAVE_CHUNKS) * mean
            rivals = [x.step_s for x in weighed if x.why_not is None]
            if rivals and guess >= min(rivals) * (1 + TIE_TOLERANCE):
                weighed.append(ScheduleEstimate(sched, m, float("inf"), float("inf"), 1.0, (),
                                                f"predicted slower (about {_ms(guess)} with balanced chunks)"))
                continue
            se, layout = _interleaved(lg, res, m, est, capacity, cluster)
            weighed.append(se)
            if layout is not None:
                layouts[sched] = layout
            continue
        se = schedule_estimate(sched, fs, bs, ws, m, layers_per_stage=nlayers)
        if se.why_not is None:
            flight = in_flight_microbatches(sched, p, m)
            over = [i for i, (e, s) in enumerate(zip(ests, res.slots)) if e.memory_bytes(flight[i], m) > capacity(s)]
            if over:
                se = dataclasses.replace(se, step_s=float("inf"), why_not=f"stage {over[0]} would exceed its memory")
        weighed.append(se)
    out = []
    for se in weighed:
        if se.why_not is not None:
            continue
        if se.schedule in layouts:
            stages, chunks, sync_i = layouts[se.schedule]
            step = se.step_s + sync_i
            out.append((step, PipelineChoice(stages, se.schedule, m, step, se.bubble_s, se.bubble_fraction,
                                             tuple(weighed), chunks=chunks)))
            continue
        flight = in_flight_microbatches(se.schedule, p, m)
        stages = tuple(
            StageChoice(i, tuple(lg.names[s.first:s.end]), (s.first, s.end), tuple(range(s.offset, s.offset + s.size)),
                        dict(e.mesh), e.batch_axis, fs[i], bs[i], ws[i], e.grad_sync_s, e.memory_bytes(flight[i], m),
                        capacity(s), e.source, fqn_placements(lg, s.first, e.param_placements))
            for i, (s, e) in enumerate(zip(res.slots, ests)))
        step = se.step_s + sync
        out.append((step, PipelineChoice(stages, se.schedule, m, step, se.bubble_s, se.bubble_fraction,
                                         tuple(weighed))))
    return out


def _interleaved(lg: LayerGraph, res: DPResult, m: int, est, capacity, cluster: Any,
                 v: int = INTERLEAVE_CHUNKS) -> tuple[ScheduleEstimate, tuple | None]:
    """Interleaved 1F1B on the DP's devices: the layers cut into ``p * v`` contiguous chunks (the cut of least
    largest chunk time, a linear partition), chunk ``j`` on stage ``j mod p``'s ranks (Narayanan et al., SC 2021);
    each chunk sends to the next chunk's stage. Returns the estimate and (stages, chunks, slowest gradient sync),
    or the estimate with why it cannot run and None."""
    p, L = len(res.slots), len(lg.layers)
    sizes = {s.size for s in res.slots}
    name = "interleaved-1f1b"

    def refuse(why: str) -> tuple[ScheduleEstimate, None]:
        return ScheduleEstimate(name, m, float("inf"), float("inf"), 1.0, (), why), None

    if p < 2:
        return refuse("needs at least 2 stages")
    if len(sizes) != 1:
        return refuse("needs every stage on a sub-mesh of the same size")
    if m % p:
        return refuse(f"needs the microbatches ({m}) to be a multiple of the stages ({p})")
    if L < p * v:
        return refuse(f"needs at least {p * v} layers ({v} model chunks per stage), the step has {L}")
    k = sizes.pop()
    offsets = [s.offset for s in res.slots]

    def chunk(a: int, b: int, j: int) -> tuple[float, float, float, StageEstimate] | None:
        i = j % p
        e = est(StageSlot(a, b, offsets[i], k))
        if e is None:
            return None
        f, bw, w = e.per_microbatch(m)
        nxt, prv = offsets[(j + 1) % p], offsets[(j - 1) % p] + k - 1
        if b < L:
            f += _send_s(cluster, offsets[i] + k - 1, nxt, lg.forward_bytes[b - 1] / m / k)
        if a > 0:
            bw += _send_s(cluster, offsets[i], prv, lg.backward_bytes[a - 1] / m / k)
        return f, bw, w, e

    n = p * v
    inf = float("inf")
    # G[j][a]: least largest chunk time cutting layers a.. into chunks j..n-1
    G = [[inf] * (L + 1) for _ in range(n + 1)]
    cut: dict[tuple[int, int], int] = {}
    G[n][L] = 0.0
    for j in range(n - 1, -1, -1):
        for a in range(L - (n - j), -1, -1):
            for b in range(a + 1, L - (n - j - 1) + 1):
                c = chunk(a, b, j)
                if c is None or G[j + 1][b] == inf:
                    continue
                val = max(sum(c[:3]), G[j + 1][b])
                if val < G[j][a]:
                    G[j][a], cut[(j, a)] = val, b
    if G[0][0] == inf:
        return refuse("no cut into chunks has a plan on every stage")
    bounds, a = [], 0
    for j in range(n):
        b = cut[(j, a)]
        bounds.append((a, b))
        a = b
    per = [[0.0, 0.0, 0.0] for _ in range(p)]
    state, acts = [0.0] * p, [0.0] * p
    ests: list[list[StageEstimate]] = [[] for _ in range(p)]
    for j, (a, b) in enumerate(bounds):
        c = chunk(a, b, j)
        assert c is not None
        i = j % p
        for x in range(3):
            per[i][x] += c[x]
        state[i] += c[3].state_bytes
        acts[i] += c[3].activation_bytes
        ests[i].append(c[3])
    se = schedule_estimate(name, [x[0] for x in per], [x[1] for x in per], [x[2] for x in per], m, v)
    flight = in_flight_microbatches(name, p, m, v)
    mem = [state[i] + flight[i] * acts[i] / m for i in range(p)]
    caps = [capacity(s) for s in res.slots]
    over = [i for i in range(p) if mem[i] > caps[i]]
    if over:
        return refuse(f"stage {over[0]} would exceed its memory ({_size(mem[over[0]])} of {_size(caps[over[0]])})")
    syncs = [sum(e.grad_sync_s for e in ests[i]) for i in range(p)]
    stages = []
    for i, s in enumerate(res.slots):
        mine = [bounds[j] for j in range(i, n, p)]
        names = tuple(nm for a, b in mine for nm in lg.names[a:b])
        e0 = ests[i][0]
        stages.append(StageChoice(i, names, mine[0], tuple(range(s.offset, s.offset + k)), dict(e0.mesh), e0.batch_axis,
                                  per[i][0], per[i][1], per[i][2], syncs[i], mem[i], caps[i], e0.source,
                                  tuple(x for (a, _), e in zip(mine, ests[i])
                                        for x in fqn_placements(lg, a, e.param_placements))))
    chunks = tuple(tuple(lg.names[a:b]) for a, b in bounds)
    return se, (tuple(stages), chunks, max(syncs))


def plan_pipeline(captured: CapturedGraph, cluster: Any, *, optimizer: str = "adamw", coster: str = "ilp",
                  spmd_step_s: float | None = None, microbatches: Sequence[int] | None = None,
                  schedules: Sequence[str] = SCHEDULES, num_stages: int | None = None,
                  time_limit_s: float = ILP_TIME_LIMIT_S, pg: PlanningGraph | None = None,
                  uniform: bool = False, submesh: Any = None, stage_sizes: Sequence[int] | None = None,
                  uneven_dp: bool = False) -> PipelineChoice:
    """Plan a pipeline for ``captured`` on ``cluster`` (module docstring): layers, stage costs, the DP, the schedule.

    Args:
        optimizer: sizes the optimizer state. coster: ``ilp`` (intra-stage planner) or ``analytic``.
        spmd_step_s: the best non-pipeline plan's predicted step (``plan_auto(...).predicted.step_s``): the
            result's ``chosen`` says whether the pipeline beats it.
        microbatches, schedules, num_stages: restrict the search (default: everything).
        pg: the planning graph if already built (``plan_auto(...).graph``).
        uniform: every stage on a sub-mesh of the same size and intra-stage mesh shape (what the pipeline
            lowering runs today): one search per shape (``dp=2``, ``tp=2``, ...), the fastest wins.
        submesh: with ``uniform``, the one intra-stage :class:`~adaptdist.mesh.Mesh` to use (``--mesh
            pp=2,dp=2`` gives ``dp=2``; its batch axis is ``dp`` if it has one); None: search.
        stage_sizes: ``--stage-ranks 2,1``: the ranks of each stage, fixed (data parallel inside each); the DP
            chooses the layer ranges, microbatches and schedule.
        uneven_dp: with ``uniform``, also search stages of different sizes, each data parallel (what the
            lowering runs on sub-meshes of different sizes), and keep the faster.

    Raises:
        PlanInfeasibleError, UsageError: see :func:`plan_stages`.
    """
    pg = pg or build_planning_graph(captured, cluster)
    lg = build_layers(pg)
    if stage_sizes is not None:
        starts = {sum(stage_sizes[:i]): n for i, n in enumerate(stage_sizes)}
        # data parallel inside the stages, parameters replicated and gradients all-reduced (what the lowering runs
        # on stages of different sizes): the analytic cost, not an ILP that may shard parameters over dp
        sc = StageCoster(lg, cluster, optimizer, "analytic", time_limit_s, dp_only=True)
        return plan_stages(lg, cluster, sc, microbatches=microbatches, schedules=schedules,
                           num_stages=len(stage_sizes), spmd_step_s=spmd_step_s,
                           sizes=lambda off, rem: [starts[off]] if starts.get(off, rem + 1) <= rem else [])
    if not uniform:
        sc = StageCoster(lg, cluster, optimizer, coster, time_limit_s)
        return plan_stages(lg, cluster, sc, microbatches=microbatches, schedules=schedules, num_stages=num_stages,
                           spmd_step_s=spmd_step_s)
    from .search import BATCH_AXIS, MeshCandidate, mesh_candidates

    t0 = time.perf_counter()
    world = cluster.world_size
    best, last_error, costs = None, None, 0
    strategies: dict = {}  # candidate strategies per node signature, shared by every shape's coster
    fixed = None
    if submesh is not None:
        fixed = MeshCandidate(submesh, BATCH_AXIS if BATCH_AXIS in submesh.names else None)
    for k in ([submesh.world_size] if submesh is not None else submesh_sizes(cluster, 0, world)):
        if world % k or world // k < 2 or any(k not in submesh_sizes(cluster, off, world - off)
                                              for off in range(0, world, k)):
            continue
        for c in ([fixed] if fixed is not None else mesh_candidates(k, pg.batch_size)):
            sc = StageCoster(lg, cluster, optimizer, coster, time_limit_s, mesh=c if k > 1 else None)
            sc.strategy_cache = strategies
            try:
                ch = plan_stages(lg, cluster, sc, microbatches=microbatches, schedules=schedules,
                                 num_stages=num_stages, spmd_step_s=spmd_step_s,
                                 sizes=lambda off, rem, k=k: [k] if k <= rem and off % k == 0 else [])
            except PlanInfeasibleError as e:
                last_error = e
                continue
            finally:
                costs += sc.misses
            if len({tuple(sorted(s.mesh.items())) for s in ch.stages}) != 1:
                continue  # a stage fell back to another shape (the ILP found no plan on this one)
            if best is None or ch.step_s < best.step_s * (1 - 1e-9):
                best = ch
            if k == 1:
                break
    if uneven_dp and submesh is None:  # data parallel inside the stages: the analytic cost (an ILP per range is slow)
        sc = StageCoster(lg, cluster, optimizer, "analytic", time_limit_s, dp_only=True)
        sc.strategy_cache = strategies
        try:
            ch = plan_stages(lg, cluster, sc, microbatches=microbatches, schedules=schedules, num_stages=num_stages,
                             spmd_step_s=spmd_step_s)
            if best is None or ch.step_s < best.step_s * (1 - TIE_TOLERANCE):
                best = ch
        except PlanInfeasibleError as e:
            last_error = last_error or e
        finally:
            costs += sc.misses
    if best is None:
        raise last_error or PlanInfeasibleError(f"no pipeline of equal sub-meshes fits {world} ranks")
    return dataclasses.replace(best, planner_s=time.perf_counter() - t0, stage_costs=costs)


# --- what the CLI prints -----------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{1e3 * s:.3f} ms"


def layer_range_text(layers: Sequence[str]) -> str:
    """A stage's layers as ``plan`` and ``explain`` both name them: ``tok_emb .. blocks.1 (4)``, ``ln_f (1)``."""
    return (layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}") + f" ({len(layers)})"


def stage_plan_lines(choice: PipelineChoice) -> list[str]:
    """The stage plan as lines for ``adaptdist plan`` / ``explain``: stages, layer ranges, sub-meshes, predicted
    per-stage times, the bubble, why this schedule, and the comparison with the best SPMD plan."""
    sync = max((s.grad_sync_s for s in choice.stages), default=0.0)
    lines = [f"pipeline plan: {choice.num_stages} stages, schedule {choice.schedule}, {choice.microbatches} "
             f"microbatches; predicted step {_ms(choice.step_s)} = pipeline {_ms(choice.step_s - sync)} + slowest "
             f"gradient sync {_ms(sync)}; bubble {_ms(choice.bubble_s)} ({100 * choice.bubble_fraction:.1f}% of the "
             "pipeline)"]
    for s in choice.stages:
        mesh = ",".join(f"{a}={n}" for a, n in s.mesh.items())
        lines.append(f"  stage {s.index}: layers {layer_range_text(s.layers)}, ranks {list(s.ranks)} (mesh {mesh}); "
                     f"per microbatch F {_ms(s.forward_s)}, B {_ms(s.backward_s)}, W {_ms(s.weight_s)}; gradient "
                     f"sync {_ms(s.grad_sync_s)}; memory {_size(s.memory_bytes)} of {_size(s.capacity_bytes)} "
                     f"({s.source})")
    if choice.chunks:
        lines.append("  model chunks in pipeline order (chunk j on stage j mod p): " + " | ".join(
            f"{j}@{j % choice.num_stages}: {c[0]}" + (f" .. {c[-1]}" if len(c) > 1 else "")
            for j, c in enumerate(choice.chunks)))
    ran = sorted((x for x in choice.schedules if x.why_not is None), key=lambda x: x.step_s)
    others = [f"{x.schedule} {_ms(x.step_s)} (bubble {_ms(x.bubble_s)})" for x in ran if x.schedule != choice.schedule]
    refused = [f"{x.schedule}: {x.why_not}" for x in choice.schedules if x.why_not is not None]
    why = (f"  why {choice.schedule}: the least predicted step over the microbatch counts tried "
           f"(pipeline {_ms(choice.step_s - sync)} at {choice.microbatches} microbatches)")
    if others:
        why += "; others " + ", ".join(others)
    if refused:
        why += "; not possible: " + "; ".join(refused)
    lines.append(why + (" (pipeline times, this cut)" if others else ""))
    if choice.spmd_step_s is not None:
        verdict = "chosen" if choice.chosen else "not chosen"
        lines.append(f"  vs the best plan without stages: {_ms(choice.spmd_step_s)} predicted; the pipeline is "
                     f"{verdict} ({choice.spmd_step_s / choice.step_s:.2f}x)" + (f": {choice.note}" if choice.note
                                                                                 else ""))
    lines.append(f"  ({choice.stage_costs} stage costs, inter-stage search {choice.planner_s:.2f} s)")
    return lines


# --- into the plan ------------------------------------------------------------------------------------

def _stage_mesh(mesh: Mapping[str, int]) -> dict[str, int]:
    """A stage's sub-mesh as a plan writes it: axes of size 1 dropped (``{}``: one rank)."""
    return {a: n for a, n in mesh.items() if n > 1}


def to_pipeline_spec(choice: PipelineChoice) -> Any:
    """``choice`` as the plan's pipeline decision (:class:`adaptdist.plan.PipelineSpec`, pp-core's field): one
    :class:`~adaptdist.plan.StageSpec` per stage with its layer names, sub-mesh, ranks and per-microbatch
    predicted seconds (``forward``, ``backward``, ``weight``, and ``grad_sync`` per step); for interleaved 1F1B
    one per model chunk in pipeline order (chunk ``j`` on rank group ``j mod p``, ``stages_per_rank`` chunks
    each), its predicted seconds the group's. The spec's ``predicted_s`` holds ``step``, ``bubble`` and, when
    compared, ``spmd_step``.

    Raises:
        UsageError: the plan module has no pipeline field (a tree without pp-core's plan.py), or the spec
            refuses the values (from ``PipelineSpec``'s checks).
    """
    try:
        from ...plan import PipelineSpec, StageSpec
    except ImportError as e:  # pp-core's field not merged
        raise UsageError("this adaptdist's plan has no pipeline field (adaptdist.plan.PipelineSpec); "
                         "plan without stages") from e

    def times(s: StageChoice) -> dict[str, float]:
        return {"forward": s.forward_s, "backward": s.backward_s, "weight": s.weight_s, "grad_sync": s.grad_sync_s}

    predicted = {"step": choice.step_s, "bubble": choice.bubble_s}
    if choice.spmd_step_s is not None:
        predicted["spmd_step"] = choice.spmd_step_s
    p = choice.num_stages
    if choice.chunks:
        stages = tuple(StageSpec(tuple(c), _stage_mesh(choice.stages[j % p].mesh), tuple(choice.stages[j % p].ranks),
                                 times(choice.stages[j % p])) for j, c in enumerate(choice.chunks))
        per_rank = len(choice.chunks) // p
    else:
        stages = tuple(StageSpec(tuple(s.layers), _stage_mesh(s.mesh), tuple(s.ranks), times(s))
                       for s in choice.stages)
        per_rank = 1
    return PipelineSpec(stages, choice.microbatches, choice.schedule, per_rank, predicted)


def pipeline_plan(captured: CapturedGraph, choice: PipelineChoice, world_size: int, inner: Any = None) -> Any:
    """The :class:`~adaptdist.plan.Plan` that runs ``choice``: pp-core's pipeline plan for its mesh (``pp`` first,
    then the stages' common sub-mesh; the sub-mesh axes' placements by the preset of their names, as
    ``--mesh pp=2,dp=2`` gives), with ``choice``'s stages, microbatches, schedule and predictions as its
    ``pipeline`` (:func:`to_pipeline_spec`). ``inner``: the plan inside the stages (a ManualPlan such as
    ``--plan tp``'s) instead of the presets; None with a model-parallel axis (``tp``...) in the sub-mesh and every
    stage costed by the ILP: the stage ILP's own parameter placements (:func:`_ilp_pipeline_plan`), not a model
    file's ``TP_PLAN``. Stages of different data-parallel sizes: the ``--stage-ranks`` plan
    (:func:`~adaptdist.compiler.pipeline_lowering.resolve_pipeline_plan`) with ``choice``'s layer ranges.

    Raises:
        UsageError: no pipeline lowering in this tree (pp-core's), or stages on different sub-meshes other than
            data-parallel ones of different sizes.
    """
    try:
        from ...annotations import ManualPlan
        from ..lowering import resolve_plan
        from ..pipeline_lowering import PipelineOptions
    except ImportError as e:
        raise UsageError("this adaptdist has no pipeline lowering (adaptdist.compiler.pipeline_lowering); "
                         "plan without stages") from e
    meshes = {tuple(_stage_mesh(s.mesh).items()) for s in choice.stages}
    spec = to_pipeline_spec(choice)
    if len(meshes) != 1:
        if any(set(m) - {"dp"} for m, _ in ((dict(x), 0) for x in meshes)) or spec.stages_per_rank > 1:
            raise UsageError(f"the pipeline's stages run on different sub-meshes {sorted(meshes)}; the pipeline "
                             "lowering runs stages of different sizes only data parallel inside each stage and not "
                             "interleaved (plan_pipeline(..., uniform=True, uneven_dp=True))")
        if inner is not None and getattr(inner, "name", None) not in ("dp", "pp"):
            raise UsageError(f"the pipeline's stages run on sub-meshes of different sizes {sorted(meshes)}: data "
                             f"parallel inside each stage, not plan {inner.name!r}")
        base = resolve_plan(None, captured, world_size, None, pipeline=PipelineOptions(
            microbatches=spec.microbatches, schedule=spec.schedule,
            stage_ranks=tuple(len(s.ranks) for s in choice.stages)))
        return dataclasses.replace(base, pipeline=spec)
    sub = dict(meshes.pop())
    text = ",".join([f"pp={spec.num_groups}"] + [f"{a}={n}" for a, n in sub.items()])
    if inner is None and set(sub) - {"dp"} and all(s.source == "ilp" for s in choice.stages):
        return _ilp_pipeline_plan(captured, choice, spec, sub)
    if inner is None:
        inner = ManualPlan.parse(",".join(sub)) if sub else None
    base = resolve_plan(inner, captured, world_size, text if sub else None,
                        pipeline=PipelineOptions(stages=spec.num_stages, microbatches=spec.microbatches,
                                                 schedule=spec.schedule, stages_per_rank=spec.stages_per_rank))
    return dataclasses.replace(base, pipeline=spec)


def _ilp_pipeline_plan(captured: CapturedGraph, choice: PipelineChoice, spec: Any, sub: Mapping[str, int]) -> Any:
    """The pipeline plan whose parameters are placed as each stage's intra-stage ILP chose (not a model file's
    ``TP_PLAN`` preset): a parameter takes the placements of the first stage holding it, replicated on the
    batch axis (the pipeline lowering does not shard parameters over it; a stage's ILP may have, for memory)."""
    from ...placement import Replicate
    from ...plan import PIPELINE_AXIS, Plan, graph_fingerprint

    batch_axis = "dp" if "dp" in sub else None
    pls: dict[str, tuple] = {}
    for st in choice.stages:
        names = list(st.mesh)
        for fqn, placements in st.param_placements:
            if fqn in pls:
                continue
            by = dict(zip(names, placements))
            pls[fqn] = (Replicate(),) + tuple(Replicate() if a == batch_axis or by.get(a) is None else by[a]
                                              for a in sub)
    return Plan(mesh={PIPELINE_AXIS: spec.num_groups, **sub}, batch_axis=batch_axis,
                param_placements={f: p for f, p in pls.items() if any(not isinstance(x, Replicate) for x in p)},
                graph_fingerprint=graph_fingerprint(captured.gm), name="pp+auto", pipeline=spec)


def with_pipeline(result: Any, captured: CapturedGraph, cluster: Any, *, optimizer: str = "adamw",
                  time_limit_s: float = ILP_TIME_LIMIT_S, progress: Callable[[str], None] | None = None) -> Any:
    """``result`` (:func:`.search.plan_auto`'s :class:`~.search.PlannerResult`) with pipeline stages weighed:
    :func:`plan_pipeline` on equal sub-meshes (and data-parallel ones of different sizes) against ``result``'s
    predicted step; where the pipeline is predicted faster, its plan (:func:`pipeline_plan`) replaces
    ``result.plan``. ``result.pipeline`` holds the stage plan
    either way (with ``chosen`` and, where it is faster but cannot be lowered in this tree, a ``note``), or why
    there is none (a str).
    """
    from ...errors import AdaptdistError

    if cluster.world_size < 2:
        return dataclasses.replace(result, pipeline="one rank: no pipeline")
    if progress:
        progress("pipeline stages")
    t0 = time.perf_counter()
    phases = dict(result.phases_s)
    try:
        choice = plan_pipeline(captured, cluster, optimizer=optimizer, spmd_step_s=result.predicted.step_s,
                               pg=result.graph, time_limit_s=time_limit_s, uniform=True, uneven_dp=True)
    except AdaptdistError as e:
        phases["stages"] = time.perf_counter() - t0
        return dataclasses.replace(result, pipeline=f"no pipeline: {e}", phases_s=phases)
    plan = result.plan
    if choice.chosen:
        try:
            plan = pipeline_plan(captured, choice, cluster.world_size)
        except AdaptdistError as e:
            choice = dataclasses.replace(choice, chosen=False, note=f"predicted faster, but not lowered: {e}")
    phases["stages"] = time.perf_counter() - t0
    return dataclasses.replace(result, plan=plan, pipeline=choice, phases_s=phases)


def pipeline_only(captured: CapturedGraph, cluster: Any, spmd_error: Exception, *, optimizer: str = "adamw",
                  time_limit_s: float = ILP_TIME_LIMIT_S, progress: Callable[[str], None] | None = None) -> Any:
    """A :class:`~.search.PlannerResult` holding the pipeline plan where no plan without stages fits
    (``spmd_error``, :func:`.search.plan_auto`'s PlanInfeasibleError): the step split into stages may fit the
    devices' memory when no sharding of the whole step does. Its ``predicted`` is the pipeline's step and its
    largest stage's memory; ``tried`` records why SPMD failed.

    Raises:
        PlanInfeasibleError: no pipeline fits either (both reasons in the message), or the pipeline cannot be
            lowered in this tree (the SPMD error, with that).
    """
    from ...errors import AdaptdistError
    from ...mesh import Mesh
    from .search import BATCH_AXIS, Evaluation, MeshCandidate, PlannerResult

    if progress:
        progress("pipeline stages (no plan without stages fits)")
    t0 = time.perf_counter()
    pg = build_planning_graph(captured, cluster)
    try:
        choice = plan_pipeline(captured, cluster, optimizer=optimizer, pg=pg, time_limit_s=time_limit_s, uniform=True,
                               uneven_dp=True)
        plan = pipeline_plan(captured, choice, cluster.world_size)
    except AdaptdistError as e:
        raise PlanInfeasibleError(f"{spmd_error}\nand with pipeline stages: {e}") from spmd_error
    mesh = Mesh(tuple(plan.mesh.items()))
    ev = Evaluation(choice.step_s, 0.0, {}, max(s.memory_bytes for s in choice.stages),
                    min(s.capacity_bytes for s in choice.stages))
    first = str(spmd_error).splitlines()[0] if str(spmd_error) else type(spmd_error).__name__
    tried = [(MeshCandidate(Mesh.one_axis(BATCH_AXIS, cluster.world_size), BATCH_AXIS), f"no SPMD plan: {first}"),
             (MeshCandidate(mesh, plan.batch_axis), ev)]
    return PlannerResult(plan, tried[1][0], ev, {}, tried, {"stages": time.perf_counter() - t0}, pg,
                         calibrated=bool(getattr(cluster, "calibrated", True)), pipeline=choice)
