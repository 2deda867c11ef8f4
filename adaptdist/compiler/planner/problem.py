"""One mesh axis's strategy-selection problem: classes, their strategies and costs, edges, memory rows.

The planner solves one mesh axis at a time with the other axes' choices held fixed (see
:mod:`.search`); this module turns the :class:`~.graph.PlanningGraph`, the axis, and those choices
into numbers the ILP (:mod:`.ilp`) reads. All times are seconds, all sizes bytes.

For a node ``v`` with strategy ``s`` on this axis of ``n`` ranks, other axes ``b`` of ``n_b`` ranks
holding strategies ``s_b``:

- compute: ``roof(v) / (F_c(v) * (n if splits(s) else 1))``, with ``F_c(v) = prod_b n_b`` over the
  axes whose strategy splits ``v``'s work. A strategy *splits* the work when any input or output is
  ``Shard`` or an output is ``Partial`` (each rank does ``1/n`` of the arithmetic).
- an edge ``u -> v`` whose producer placement ``p`` differs from what the consumer's strategy needs, ``q``:
  :func:`reshard_time_s` of the tensor's bytes as the other axes leave it (divided by ``n_b`` on every axis ``b``
  where it is ``Shard``). Each collective kind runs at its own figures (:func:`axis_links`): on a calibrated
  cluster the measured fit of that kind (gloo's all_reduce of 1 MiB on 2 ranks costs less than its all_gather plus
  its reduce_scatter, which the ring formulas on one shared fit would call equal). Gradient reductions
  (all_reduce, reduce_scatter) and parameter all_gathers are bucketed by the lowering (``bucket_grad_*``,
  ``bucket_param_allgather``: many tensors per message), so each tensor is charged bandwidth only, and the
  per-message latency once per step for each such kind any choice uses (:attr:`AxisProblem.bucket_latency_s`: a
  bucket is at least one collective, whatever shares it; the ILP's ``bucket[kind]`` indicator); a parameter's
  edges count :data:`PARAM_GATHERS` times (gathered for forward and again for backward), and so does the
  latency of its gathers' buckets.
- memory at each of the graph's peak steps: every live tensor's bytes over ``n`` when ``Shard`` on
  this axis (and over ``n_b`` per other sharded axis), whole when ``Replicate`` or ``Partial``; a
  parameter counts itself, its gradient (which ends in the parameter's placement) and its optimizer
  state (``state_copies`` more copies, in the parameter's placement). An axis not solved yet is
  assumed to shard everything it could (optimistic), so no axis is refused for memory another axis
  would have freed; the final plan is checked with every axis known (:func:`.search.evaluate`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ... import graph_meta as gmeta
from ...cost_models.communication import LinkCost, collective_time_s, link_cost
from ...errors import PlanInfeasibleError, UnsupportedOpError
from ...mesh import Mesh
from ...passes.context import PassContext
from ...passes.gather_embedding_rows import gathered_when_batch_split
from ...passes.list_strategies import node_strategies
from ...passes.sharding_rules import tensor_args
from ...placement import Partial, Placement, Replicate, Shard
from ...redistribute import transition_collective
from ...strategy import Strategy
from .graph import PlanningGraph

R = Replicate()
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)

PARAM_GATHERS = 2
"""A sharded parameter is gathered twice per step: for the forward and again for the backward
(``regather_in_backward`` frees it in between), so its edges' collectives count twice."""


def splits(s: Strategy) -> bool:
    """Whether strategy ``s`` divides its node's work over the axis (module docstring)."""
    return any(isinstance(p, Shard) for p in s.inputs + s.outputs if p is not None) or \
        any(isinstance(p, Partial) for p in s.outputs if p is not None)


def reshard_collective(src: Placement | None, dst: Placement | None) -> str | None:
    """The collective that turns ``src`` into ``dst`` on one axis (None: nothing to do or a local slice):
    P->R all_reduce, P->S reduce_scatter, S->R all_gather, S(i)->S(j) all_to_all, S->P all_gather
    (then a local zeroing), R->S and R->P local: :func:`adaptdist.redistribute.transition_collective`."""
    return transition_collective(src, dst)


def reshard_time_s(src: Placement | None, dst: Placement | None, nbytes: float, n: int, alpha_s: float,
                   beta_s_per_byte: float, bucketed: frozenset[str] = frozenset(),
                   links: Mapping[str, LinkCost] | None = None) -> float:
    """Seconds to turn a tensor of ``nbytes`` (its full size on this axis) from ``src`` into ``dst`` over
    ``n`` ranks: the collective of :func:`reshard_collective` by the α-β formulas of
    :func:`adaptdist.cost_models.communication.collective_time_s`, the faster of ring and tree
    (``algorithm="auto"``, as NCCL picks per message size); all_to_all moves each rank's ``nbytes / n``.
    ``links`` (collective kind -> its figures, :func:`axis_links`) replaces ``alpha_s`` / ``beta_s_per_byte``
    for the kinds it holds; a calibrated one is read with the ring formula, the one its fit was converted by
    (so the measured fit comes back, as :func:`adaptdist.cost_models.estimate.collective_costs` reads it).
    A collective whose kind is in ``bucketed`` shares its message with others (the lowering's buckets):
    it pays bandwidth only, no latency."""
    kind = reshard_collective(src, dst)
    if kind is None or n < 2:
        return 0.0
    size = nbytes / n if kind == "all_to_all" else nbytes
    link = (links or {}).get(kind)
    algorithm = "ring" if link is not None and link.calibrated else "auto"
    if link is not None:
        alpha_s, beta_s_per_byte = link.alpha_s, link.beta_s_per_byte
    alpha = 0.0 if kind in bucketed else alpha_s
    return float(collective_time_s(kind, size, n, alpha, beta_s_per_byte, algorithm))


def reshard_bytes(src: Placement | None, dst: Placement | None, nbytes: float, n: int) -> float:
    """Bytes each rank sends to turn a tensor of ``nbytes`` (its full size on this axis) from ``src`` into ``dst``
    over ``n`` ranks: the ring volume of :func:`reshard_collective`'s collective (all_reduce ``2 (n-1)/n nbytes``,
    all_gather / reduce_scatter ``(n-1)/n nbytes``, all_to_all ``(n-1)/n nbytes / n``: the beta terms of
    :func:`adaptdist.cost_models.communication.ring_time_s` at one second per byte), 0 when nothing moves. The
    ILP's tie-break (:data:`.ilp.TIE_BREAK_UNITS`) reads it; it is not a time."""
    kind = reshard_collective(src, dst)
    if kind is None or n < 2:
        return 0.0
    size = nbytes / n if kind == "all_to_all" else nbytes
    return float(collective_time_s(kind, size, n, 0.0, 1.0, "ring"))


def bucket_latency_s(kind: str, n: int, alpha_s: float, beta_s_per_byte: float,
                     links: Mapping[str, LinkCost] | None = None) -> float:
    """Seconds of one bucketed ``kind`` collective's latency over ``n`` ranks: :func:`reshard_time_s`'s formula at
    0 bytes (its alpha terms), at ``links``' figures for ``kind`` where it has them."""
    if n < 2:
        return 0.0
    link = (links or {}).get(kind)
    algorithm = "ring" if link is not None and link.calibrated else "auto"
    if link is not None:
        alpha_s, beta_s_per_byte = link.alpha_s, link.beta_s_per_byte
    return float(collective_time_s(kind, 0.0, n, alpha_s, beta_s_per_byte, algorithm))


RESHARD_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""The collectives a reshard on one axis issues (:func:`reshard_collective`)."""


def axis_links(cluster: Any, members: Sequence[int]) -> dict[str, LinkCost]:
    """Each of :data:`RESHARD_KINDS` -> the figures it runs at over ``members``
    (:func:`adaptdist.cost_models.communication.link_cost`: the cluster's measured fit of that kind where it has
    one, else the links' latency and bandwidth).

    Raises:
        ClusterSpecError: a member outside the cluster, or a link without positive bandwidth.
    """
    return {k: link_cost(cluster, k, members) for k in RESHARD_KINDS}


GRADIENT_BUCKETS = frozenset({"all_reduce", "reduce_scatter"})
"""Gradient reductions the lowering buckets (``bucket_grad_allreduce``, ``bucket_grad_reduce_scatter``)."""
PARAM_BUCKETS = frozenset({"all_gather"})
"""Parameter gathers the lowering buckets (``bucket_param_allgather``)."""


@dataclass
class ClassVar:
    """One decision: the nodes of a layer class and the strategies they may take together.

    ``compute_s[k]`` sums the members' compute under strategy ``k``; ``reshard_s[k]`` the resharding
    on edges whose both ends are this decision and into the graph's replicated outputs (the loss);
    ``memory_bytes[j][k]`` the members' bytes
    live at peak step ``j``; ``allowed`` the strategy indices user pins and forbidden axes leave.
    """

    key: str
    members: list[str]
    strategies: list[Strategy]
    compute_s: list[float]
    memory_bytes: list[list[float]]
    allowed: list[int]
    why_restricted: list[str] = field(default_factory=list)
    reshard_s: list[float] = field(default_factory=list)
    followers: list[str] = field(default_factory=list)
    reshard_bytes: list[float] = field(default_factory=list)
    buckets: list[frozenset[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reshard_s:
            self.reshard_s = [0.0] * len(self.strategies)
        if not self.reshard_bytes:
            self.reshard_bytes = [0.0] * len(self.strategies)
        if not self.buckets:
            self.buckets = [frozenset()] * len(self.strategies)


@dataclass
class EdgeVar:
    """Resharding between two classes: ``cost_s[p][q]`` when the source's strategy puts its output in
    ``src_places[p]`` and the destination's strategy needs ``dst_places[q]``; ``src_of[k]`` /
    ``dst_of[k]`` map each strategy index to its place index; ``bytes_moved[p][q]`` the bytes per rank the
    reshard moves (:func:`reshard_bytes`; empty: none known, the ILP's tie-break then reads 0); ``buckets[p][q]`` the
    bucketed collective kind it issues, ``""`` for none (:attr:`AxisProblem.bucket_latency_s`; empty: none)."""

    src: int
    dst: int
    src_places: list[Placement | None]
    dst_places: list[Placement | None]
    src_of: list[int]
    dst_of: list[int]
    cost_s: list[list[float]]
    what: list[str] = field(default_factory=list)
    bytes_moved: list[list[float]] = field(default_factory=list)
    buckets: list[list[str]] = field(default_factory=list)


@dataclass
class AxisProblem:
    """See the module docstring: ``vars``, ``edges``, memory rows (``capacity_bytes - fixed_bytes[j]`` is
    what the choices may use at peak step ``j``); ``bucket_latency_s``: each bucketed collective kind (module
    docstring) -> the latency it adds once per step when any choice issues it."""

    axis: str
    size: int
    vars: list[ClassVar]
    edges: list[EdgeVar]
    capacity_bytes: float
    fixed_bytes: list[float]
    peak_steps: list[int]
    var_of: dict[str, int]
    alpha_s: float
    beta_s_per_byte: float
    strat_of: dict[str, list[Strategy]] = field(default_factory=dict)
    links: dict[str, LinkCost] = field(default_factory=dict)  # collective kind -> its figures (axis_links)
    bucket_latency_s: dict[str, float] = field(default_factory=dict)  # bucketed kind -> its latency once per step

    def buckets(self, choice: Sequence[int]) -> set[str]:
        """The bucketed collective kinds ``choice`` issues on this axis (each pays its latency once)."""
        out: set[str] = set()
        for i, v in enumerate(self.vars):
            out |= v.buckets[choice[i]]
        for e in self.edges:
            if e.buckets:
                b = e.buckets[e.src_of[choice[e.src]]][e.dst_of[choice[e.dst]]]
                if b:
                    out.add(b)
        return out

    def objective_s(self, choice: Sequence[int]) -> float:
        """Predicted seconds of this axis's part of the step for ``choice`` (strategy index per var)."""
        return self.compute_s(choice) + self.communication_s(choice)

    def compute_s(self, choice: Sequence[int]) -> float:
        return sum(v.compute_s[choice[i]] for i, v in enumerate(self.vars))

    def communication_s(self, choice: Sequence[int]) -> float:
        t = sum(v.reshard_s[choice[i]] for i, v in enumerate(self.vars))
        for e in self.edges:
            t += e.cost_s[e.src_of[choice[e.src]]][e.dst_of[choice[e.dst]]]
        return t + sum(self.bucket_latency_s.get(b, 0.0) for b in self.buckets(choice))

    def communication_bytes(self, choice: Sequence[int]) -> float:
        """Bytes per rank the reshards of ``choice`` move (:func:`reshard_bytes`): the ILP's tie-break."""
        b = sum(v.reshard_bytes[choice[i]] for i, v in enumerate(self.vars))
        for e in self.edges:
            if e.bytes_moved:
                b += e.bytes_moved[e.src_of[choice[e.src]]][e.dst_of[choice[e.dst]]]
        return b

    def memory_bytes(self, choice: Sequence[int]) -> float:
        """The most bytes any peak step holds under ``choice``."""
        return max((self.fixed_bytes[j] + sum(v.memory_bytes[j][choice[i]] for i, v in enumerate(self.vars))
                    for j in range(len(self.peak_steps))), default=0.0)

    def memory_ok(self, choice: Sequence[int]) -> bool:
        return all(self.fixed_bytes[j] + sum(v.memory_bytes[j][choice[i]] for i, v in enumerate(self.vars))
                   <= self.capacity_bytes for j in range(len(self.peak_steps)))


@dataclass(frozen=True)
class Constraints:
    """User constraints. ``pins``: parameter-name glob or node name -> placement text per mesh axis name
    (``{"blocks.*.fc.weight": {"tp": "S(0)"}}``); ``forbid``: node-name or parameter glob -> axes on
    which it must not be split."""

    pins: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    forbid: Mapping[str, Sequence[str]] = field(default_factory=dict)


def _matches(pattern: str, pg: PlanningGraph, name: str) -> bool:
    pn = pg.nodes[name]
    return fnmatch.fnmatchcase(name, pattern) or (pn.fqn is not None and fnmatch.fnmatchcase(pn.fqn, pattern))


def pinned_nodes(pg: PlanningGraph, constraints: Constraints) -> dict[str, str]:
    """node name -> a text of the pins and forbids on it (for :func:`~.graph.signature`)."""
    out: dict[str, list[str]] = {}
    for pat, axes in constraints.pins.items():
        for name in pg.nodes:
            if _matches(pat, pg, name):
                out.setdefault(name, []).append(f"pin {pat}={dict(axes)}")
    for pat, axes in constraints.forbid.items():
        for name in pg.nodes:
            if _matches(pat, pg, name):
                out.setdefault(name, []).append(f"forbid {pat}={list(axes)}")
    return {k: ";".join(v) for k, v in out.items()}


def strategies_on_axis(pg: PlanningGraph, n: int, batch_axis: bool, cache: dict, replicate_fallback: bool = False
                       ) -> dict[str, list[Strategy]]:
    """Each node's candidate strategies on an axis of ``n`` ranks (list_strategies' candidates, memoized
    by node signature): batch inputs ``S(0)`` on the batch axis and ``R`` elsewhere; outputs never
    sharded on a dim shorter than ``n`` (every rank would hold a sliver or nothing), nor inputs (a size-1
    broadcast dim split over the axis: the op would fail on a rank's empty slice) unless no strategy is left. With ``replicate_fallback``
    an op with no strategy gathers its inputs and runs whole on every rank (the lowering's ``--replicate-fallback``).

    Raises:
        UnsupportedOpError: a node has no strategy at all (names op, node and shapes).
    """
    ctx = PassContext(axis_size=n, batch_size=pg.batch_size, mesh_axis="plan", shard_batch=batch_axis,
                      replicate_fallback=replicate_fallback)
    out: dict[str, list[Strategy]] = {}
    for name in pg.order:
        fx = pg.fx_nodes[name]
        if name in pg.aliases:
            continue
        pn = pg.nodes[name]
        if pn.kind == "batch":
            out[name] = [Strategy((), (Shard(0) if batch_axis and pg.batch_size > 1 else R,), "adaptdist")]
            continue
        rows_gathered = batch_axis and n >= 2 and gathered_when_batch_split(fx)
        key = (pn.signature, n, batch_axis, replicate_fallback, rows_gathered)
        if key not in cache:
            found = node_strategies(fx, ctx)
            if rows_gathered:
                # the lowering (passes/gather_embedding_rows.py) never leaves this gradient Partial over the
                # batch: it gathers the rows and ids and builds it whole, which is the (R, ..., R) -> R strategy
                # (an EmbeddingBag's backward: its gradient rows and ids gathered; its offsets and the forward's
                # offset2bag, bag_size and max_indices are split or replicated as they come, as the rewrite reads none)
                found = [s for s in found if not (isinstance(_out(s, 0), Partial) and Shard(0) in s.inputs[:2])]
            keep = [s for s in found if all(
                not isinstance(p, Shard) or (k < len(pn.out_shapes) and p.dim < len(pn.out_shapes[k])
                                             and pn.out_shapes[k][p.dim] >= n)
                for k, p in enumerate(s.outputs))]
            # nor an input split on a dim shorter than n (a size-1 broadcast dim, e.g. rotary cos/sin
            # [1, 1, T, D] beside a batch-split query): the lowering would hand a rank an empty slice and
            # the op would fail on its local shapes; unless that leaves the node nothing (the lowering's
            # departure then stays the safety net)
            fits = [s for s in keep if _inputs_fit(fx, s, n)]
            keep = fits or keep
            if fx.target in _VIEWS:
                keep = [st for st in keep if _view_shards_align(fx, st, n)]
            if not keep and fx.op == "call_function" and not tensor_args(fx):
                keep = [Strategy((), (R,), "adaptdist")]  # a factory op (arange, zeros): made whole on every rank
            if not keep and fx.op == "call_function" and replicate_fallback:
                keep = [Strategy((R,) * len(tensor_args(fx)), (R,), "adaptdist")]  # gathered, run whole
            if not keep and fx.op == "call_function":
                raise UnsupportedOpError(f"op {fx.target} at node {name!r}{gmeta.where_of(fx)} ({gmeta.shape_str(fx)}) "
                                         "has no sharding strategy the planner can use; see "
                                         "adaptdist/passes/sharding_rules.py")
            cache[key] = keep
        out[name] = cache[key]
        gmeta.set_strategies(fx, out[name])  # a getitem's strategies are read from its producer's
    return out


def _inputs_fit(node: torch.fx.Node, st: Strategy, n: int) -> bool:
    """Whether every input ``st`` shards (``Shard(d)``) has at least ``n`` entries along ``d``, so that no rank
    of an axis of ``n`` gets an empty slice (inputs in :func:`~adaptdist.passes.sharding_rules.tensor_args`
    order; a non-tensor input, or a placement that is not a single Shard, is not checked)."""
    for p, (_, a) in zip(st.inputs, tensor_args(node)):
        if isinstance(p, Shard):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor) and (p.dim >= v.dim() or v.shape[p.dim] < n):
                return False
    return True


def _chunk_bounds(size: int, n: int) -> list[int]:
    """End of each rank's torch.chunk of ``size`` rows over ``n`` ranks."""
    step = -(-size // n) if size else 0
    return [min(size, (r + 1) * step) for r in range(n)]


def _view_shards_align(node: Any, st: Strategy, n: int) -> bool:
    """Whether a view/reshape strategy that keeps a sharded dim sharded is one the lowering can run: every
    rank's chunk of the input dim must be exactly its chunk of the output dim, in whole groups (the
    lowering refuses a shard that cuts a group, e.g. 91 = 7 x 13 rows over 2 ranks)."""
    src = node.args[0]
    if not st.inputs or not isinstance(st.inputs[0], Shard) or not st.outputs or not isinstance(st.outputs[0], Shard):
        return True
    n_in = src.meta["val"].shape[st.inputs[0].dim]
    n_out = node.meta["val"].shape[st.outputs[0].dim]
    if n_in == n_out:
        return True
    big, small = (n_out, n_in) if n_out > n_in else (n_in, n_out)
    if small == 0 or big % small:
        return False
    r = big // small
    return [b * r for b in _chunk_bounds(small, n)] == _chunk_bounds(big, n)


@dataclass
class OtherAxis:
    """An axis other than the one being solved: its size and, once solved, each node's strategy."""

    name: str
    size: int
    chosen: Mapping[str, Strategy] | None = None


def _out(s: Strategy | None, idx: int) -> Placement | None:
    if s is None or idx >= len(s.outputs):
        return None
    return s.outputs[idx]


def factors(pg: PlanningGraph, others: Sequence[OtherAxis]) -> tuple[dict[str, float], dict[tuple[str, int], float],
                                                                       dict[tuple[str, int], float]]:
    """Per node: the compute divisor from other axes; per (node, output): the bytes divisor for
    communication (solved axes only) and for memory (unsolved axes count as sharding, optimistic)."""
    fc, fb, fm = {}, {}, {}
    for name, pn in pg.nodes.items():
        c = 1.0
        for o in others:
            if o.chosen is not None and name in o.chosen and splits(o.chosen[name]):
                c *= o.size
        fc[name] = c
        for k in range(len(pn.out_bytes)):
            b = m = 1.0
            for o in others:
                if o.chosen is None:
                    m *= o.size
                elif isinstance(_out(o.chosen.get(name), k), Shard):
                    b *= o.size
                    m *= o.size
            fb[(name, k)] = b
            fm[(name, k)] = m
    return fc, fb, fm


def build_axis_problem(pg: PlanningGraph, mesh: Mesh, axis: str, batch_axis: str | None, cluster: Any,
                       strategies: Mapping[str, list[Strategy]], others: Sequence[OtherAxis],
                       constraints: Constraints, state_copies: int, capacity_bytes: float) -> AxisProblem:
    """The :class:`AxisProblem` of ``axis`` (module docstring).

    Raises:
        PlanInfeasibleError: a pin names a placement no strategy of its node has on this axis.
    """
    n = mesh.size(axis)
    members = mesh.group(axis, 0)
    lc = link_cost(cluster, "all_gather", members)
    links = axis_links(cluster, members)
    fc, fb, fm = factors(pg, others)
    var_of: dict[str, int] = {}
    strat_of: dict[str, list[Strategy]] = {}  # each node's strategy under each strategy index of its var
    root_kind: dict[str, str] = {}
    vars_: list[ClassVar] = []
    class_var: dict[str, int] = {}
    steps = pg.peak_steps
    in_edges: dict[str, list] = {}
    for e in pg.edges:
        in_edges.setdefault(e.dst, []).append(e)
    pinned = set(pinned_nodes(pg, constraints))
    for m in pg.order:
        if m not in pg.nodes:
            continue
        pn = pg.nodes[m]
        follow = _follow(m, pn, in_edges.get(m, []), strategies, var_of, strat_of, pinned)
        if follow is not None:
            u, mapped = follow
            var_of[m], strat_of[m], root_kind[m] = var_of[u], mapped, root_kind[u]
            vars_[var_of[u]].followers.append(m)
        else:
            i = class_var.get(pn.layer_class)
            if i is None or len(vars_[i].strategies) != len(strategies[m]):
                i = len(vars_)
                st = strategies[m]
                vars_.append(ClassVar(m, [], st, [0.0] * len(st), [[0.0] * len(st) for _ in steps],
                                      list(range(len(st)))))
                class_var.setdefault(pn.layer_class, i)
            vars_[i].members.append(m)
            var_of[m], strat_of[m], root_kind[m] = i, vars_[i].strategies, pn.kind
        v = vars_[var_of[m]]
        for k, s in enumerate(strat_of[m]):
            v.compute_s[k] += pn.roof_s / (fc[m] * (n if splits(s) else 1))
            for j, step in enumerate(steps):
                if pn.kind in ("param", "buffer"):
                    copies = 1 + (state_copies + 1 if pn.kind == "param" and m in pg.grad_of else 0)
                elif pn.live[0] <= step <= pn.live[1]:
                    copies = 1
                else:
                    continue
                for oi, b in enumerate(pn.out_bytes):
                    v.memory_bytes[j][k] += copies * b / fm[(m, oi)] / (n if isinstance(_out(s, oi), Shard) else 1)
    for v in vars_:
        if len(v.members) > 1:
            v.key = f"{v.members[0]} (+{len(v.members) - 1} alike)"
    _apply_constraints(pg, vars_, var_of, axis, n, constraints)
    edge_map: dict[tuple, EdgeVar] = {}
    cost_memo: dict[tuple, tuple] = {}  # repeated layers repeat the same matrices
    latency: dict[str, float] = {}  # bucketed collective kind -> its latency once per step

    def add_edge(src: str, idx: int, dst_var: int, dst_place_of: list[Placement | None], what: str,
                 bucketed: frozenset[str] = frozenset(), repeats: int = 1) -> None:
        sv = var_of[src]
        src_places_all = [_out(st, idx) for st in strat_of[src]]
        src_places = list(dict.fromkeys(src_places_all))
        dst_places = list(dict.fromkeys(dst_place_of))
        nbytes = pg.nodes[src].out_bytes[idx] / fb[(src, idx)] if idx < len(pg.nodes[src].out_bytes) else 0
        mkey = (tuple(src_places), tuple(dst_places), nbytes, bucketed, repeats)
        memo = cost_memo.get(mkey)
        if memo is None:
            memo = ([[repeats * reshard_time_s(p, q, nbytes, n, lc.alpha_s, lc.beta_s_per_byte, bucketed, links)
                      for q in dst_places] for p in src_places],
                    [[repeats * reshard_bytes(p, q, nbytes, n) for q in dst_places] for p in src_places],
                    [[_bucket_of(p, q, n, bucketed) for q in dst_places] for p in src_places])
            cost_memo[mkey] = memo
        cost, moved, bucket = memo
        for row in bucket:
            for b in row:
                if b and b not in latency:
                    latency[b] = repeats * bucket_latency_s(b, n, lc.alpha_s, lc.beta_s_per_byte, links)
        if not any(c > 0 for row in cost for c in row) and not any(b > 0 for row in moved for b in row):
            return
        sp, dp = {p: i for i, p in enumerate(src_places)}, {q: i for i, q in enumerate(dst_places)}
        src_of = [sp[p] for p in src_places_all]
        dst_of = [dp[q] for q in dst_place_of]
        if sv == dst_var:  # both ends are one decision: the cost lands on that decision's strategies
            for k in range(len(src_of)):
                vars_[sv].reshard_s[k] += cost[src_of[k]][dst_of[k]]
                vars_[sv].reshard_bytes[k] += moved[src_of[k]][dst_of[k]]
                b = bucket[src_of[k]][dst_of[k]]
                if b:
                    vars_[sv].buckets[k] = vars_[sv].buckets[k] | {b}
            return
        key = (sv, dst_var, tuple(src_of), tuple(dst_of))
        e = edge_map.get(key)
        if e is None:
            edge_map[key] = EdgeVar(sv, dst_var, src_places, dst_places, src_of, dst_of, [list(r) for r in cost],
                                    [what], [list(r) for r in moved], [list(r) for r in bucket])
        else:
            e.cost_s = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(e.cost_s, cost)]
            e.bytes_moved = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(e.bytes_moved, moved)]
            e.buckets = [[b1 or b2 for b1, b2 in zip(r1, r2)] for r1, r2 in zip(e.buckets, bucket)]  # (p, q): one kind
            if len(e.what) < 4:
                e.what.append(what)

    rows_gathered = {m for m in var_of if batch_axis == axis and n >= 2 and gathered_when_batch_split(pg.fx_nodes[m])}
    for e in pg.edges:
        if e.src not in var_of or e.dst not in var_of:
            continue
        dv = var_of[e.dst]
        places = [st.inputs[e.slot] if e.slot < len(st.inputs) else None for st in strat_of[e.dst]]
        from_param = root_kind[e.src] == "param"  # a parameter, or a view that follows one (its transpose)
        # an embedding gradient's rows and ids: every table's in one all_gather (passes/bucket_gathered_rows.py)
        bucketed = PARAM_BUCKETS if from_param or e.dst in rows_gathered else frozenset()
        add_edge(e.src, e.src_index, dv, places, f"{e.src}->{e.dst}", bucketed=bucketed,
                 repeats=PARAM_GATHERS if from_param else 1)
    for param, (src, idx) in pg.grad_of.items():
        if src in var_of and param in var_of:
            pv = var_of[param]
            add_edge(src, idx, pv, [_out(st, 0) for st in strat_of[param]], f"gradient {src}->{param}",
                     bucketed=GRADIENT_BUCKETS)
    for src, idx in ([pg.loss] if pg.loss else []) + list(pg.replicated_outputs):
        if src not in var_of:
            continue
        sv = var_of[src]
        nbytes = pg.nodes[src].out_bytes[idx] / fb[(src, idx)]
        for k, st in enumerate(strat_of[src]):
            vars_[sv].reshard_s[k] += reshard_time_s(_out(st, idx), R, nbytes, n, lc.alpha_s, lc.beta_s_per_byte,
                                                     links=links)
            vars_[sv].reshard_bytes[k] += reshard_bytes(_out(st, idx), R, nbytes, n)
    batch_layout = Shard(0) if batch_axis == axis and pg.batch_size > 1 else R
    for src, idx in pg.per_rank_outputs:
        if src not in var_of:
            continue
        sv = var_of[src]
        nbytes = pg.nodes[src].out_bytes[idx] / fb[(src, idx)]
        for k, st in enumerate(strat_of[src]):
            vars_[sv].reshard_s[k] += reshard_time_s(_out(st, idx), batch_layout, nbytes, n, lc.alpha_s,
                                                     lc.beta_s_per_byte, links=links)
            vars_[sv].reshard_bytes[k] += reshard_bytes(_out(st, idx), batch_layout, nbytes, n)
    fixed = [0.0 for _ in steps]
    return AxisProblem(axis, n, vars_, list(edge_map.values()), capacity_bytes, fixed, list(steps), var_of,
                       lc.alpha_s, lc.beta_s_per_byte, strat_of, links, latency)


def _bucket_of(src: Placement | None, dst: Placement | None, n: int, bucketed: frozenset[str]) -> str:
    """The bucketed collective kind the reshard ``src -> dst`` issues, ``""`` for none (module docstring)."""
    kind = reshard_collective(src, dst)
    return kind if kind is not None and kind in bucketed and n >= 2 else ""


def _follow(m: str, pn, ins: list, strategies: Mapping[str, list[Strategy]], var_of: Mapping[str, int],
            strat_of: Mapping[str, list[Strategy]], pinned: set[str]) -> tuple[str, list[Strategy]] | None:
    """Coarsening: ``m`` joins its producer's decision when it has one tensor input (an elementwise or view
    op, a reduction...), is not pinned, and for every strategy of the producer's decision has a strategy
    taking that output as it is; it then takes the first such (its list is DTensor's order). Returns
    (producer, ``m``'s strategy per producer strategy index) or None."""
    if pn.kind != "op" or len(ins) != 1 or m in pinned:
        return None
    e = ins[0]
    if e.src not in var_of or e.src in pinned:
        return None
    mapped = []
    for st in strat_of[e.src]:
        p = _out(st, e.src_index)
        s = next((c for c in strategies[m] if e.slot < len(c.inputs) and c.inputs[e.slot] == p), None)
        if s is None:
            return None
        mapped.append(s)
    return e.src, mapped


def _apply_constraints(pg: PlanningGraph, vars_: list[ClassVar], var_of: Mapping[str, int], axis: str, n: int,
                       constraints: Constraints) -> None:
    from ...placement import parse_placement

    for pat, per_axis in constraints.pins.items():
        if axis not in per_axis:
            continue
        want = parse_placement(per_axis[axis])
        hit = [m for m in pg.nodes if _matches(pat, pg, m) and m in var_of]
        for m in hit:
            v = vars_[var_of[m]]
            ok = [k for k in v.allowed if _out(v.strategies[k], 0) == want]
            if not ok:
                have = sorted({repr(_out(s, 0)) for s in v.strategies})
                raise PlanInfeasibleError(
                    f"pin {pat!r}: {want!r} on mesh axis {axis!r} ({n} ranks) is not a placement node {m!r} "
                    f"({pg.nodes[m].fqn or pg.fx_nodes[m].target}, shape {list(pg.nodes[m].out_shapes[0])}) can take; "
                    f"it can take {', '.join(have)}")
            v.allowed = ok
            v.why_restricted.append(f"pinned {want!r} by {pat!r}")
    for pat, axes in constraints.forbid.items():
        if axis not in axes:
            continue
        for m in pg.nodes:
            if _matches(pat, pg, m) and m in var_of:
                v = vars_[var_of[m]]
                v.allowed = [k for k in v.allowed if not splits(v.strategies[k])]
                v.why_restricted.append(f"not split on {axis!r} ({pat!r})")


def chosen_strategies(problem: AxisProblem, choice: Sequence[int]) -> dict[str, Strategy]:
    """node name -> its strategy under ``choice`` (a follower's: the one its decision's choice maps to)."""
    if problem.strat_of:
        return {m: problem.strat_of[m][choice[i]] for m, i in problem.var_of.items()}
    return {m: problem.vars[i].strategies[choice[i]] for m, i in problem.var_of.items()}

