"""The planner's view of a captured step: nodes, tensor edges, costs on one device, liveness, layer classes.

Built once per captured graph, independent of the mesh:

- **nodes**: every placeholder and every ``call_function`` that yields tensors, in graph (schedule)
  order. ``operator.getitem`` on a multi-output op is an *alias* ``(producer, index)``, not a node:
  its placement is its producer's output ``index``.
- **edges**: ``(producer, output index) -> (consumer, input slot)`` for every tensor argument, slots
  numbered as :func:`~adaptdist.passes.sharding_rules.tensor_args` numbers them (the order of a
  :class:`~adaptdist.strategy.Strategy`'s inputs).
- **requirements** from the graph's outputs: the loss and updated buffers end ``Replicate``; each
  parameter's gradient ends in its parameter's placement (:attr:`PlanningGraph.grad_of`).
- **compute time** of every node on the slowest device of the cluster, unsharded: the cost model's
  roofline (:func:`adaptdist.cost_models.compute.node_time_s`, FLOPs from torch's FlopCounterMode
  formulas), so a node split ``k`` ways costs ``roof / k``.
- **liveness**: each non-view tensor is live from the node that makes it to its last use (through
  views); :attr:`PlanningGraph.peak_steps` are the schedule steps where the unsharded step holds the
  most bytes. The memory constraints are written at those steps.
- **layer classes**: nodes that play the same part in repeated layers share one class (and so one
  decision): a Weisfeiler-Lehman refinement (Shervashidze et al., JMLR 12, 2011) of each node's
  signature (op, shapes, dtypes, constant arguments; a parameter's name with its layer index
  replaced by ``#``) over its inputs and users, :data:`WL_ROUNDS` rounds; then split by the parity of the
  node's layer (:func:`~.layers.build_layers`), so that consecutive repeated layers may alternate. A stack
  of identical ``Linear`` layers is one class to the refinement, and one decision for all of them cannot
  express Megatron's column-parallel / row-parallel pairs (layer ``2i`` ``S(0)``, layer ``2i+1`` ``S(1)``:
  one all_reduce per pair instead of an all_gather per layer and a reduce_scatter per layer in backward);
  two decisions (even, odd) can, and the number of decisions still does not grow with the depth.
"""

from __future__ import annotations

import hashlib
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx

from ... import graph_meta as gmeta
from ...cost_models import compute as compute_cost
from ...cost_models.hardware import op_overhead_s
from ...passes.context import PassContext
from ...passes.decompose_addmm import decompose_addmm
from ...passes.infra import copy_graph_module
from ...passes.sharding_rules import tensor_args
from ..capture import CapturedGraph

WL_ROUNDS = 3
"""Rounds of signature refinement: nodes whose neighbourhoods agree this many hops out share a class."""

NUM_PEAK_STEPS = 3
"""How many of the unsharded step's highest-memory schedule steps get a memory constraint."""

_LAYER_INDEX = re.compile(r"\.\d+\.")


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from output ``src_index`` of node ``src`` into input slot ``slot`` of ``dst``."""

    src: str
    src_index: int
    dst: str
    slot: int


@dataclass
class PNode:
    """One decision-carrying node (see the module docstring).

    Attributes:
        name: the fx node's name.
        kind: ``param``, ``buffer``, ``batch`` or ``op``.
        fqn: parameter/buffer name (placeholders), else None.
        out_bytes: bytes of each output (0 where an output is absent).
        out_shapes: shape of each output (``()`` where absent).
        roof_s: unsharded compute time on the slowest device (0 for placeholders), seconds.
        overhead_s: per-op dispatch overhead on that device, seconds (not divided by sharding).
        signature: what the node is, without its place in the graph (module docstring).
        layer_class: its class among repeated layers (same class, same decision).
        live: schedule steps (indices into :attr:`PlanningGraph.order`) where its outputs are live.
    """

    name: str
    kind: str
    fqn: str | None
    out_bytes: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    roof_s: float
    overhead_s: float
    signature: str
    layer_class: str = ""
    live: tuple[int, int] = (0, 0)


@dataclass
class PlanningGraph:
    """See the module docstring. ``gm`` is the captured graph after ``decompose_addmm`` (the lowering's
    first pass, so node names match what the lowering sees)."""

    gm: torch.fx.GraphModule
    nodes: dict[str, PNode]
    order: list[str]
    edges: list[Edge]
    aliases: dict[str, tuple[str, int]]
    loss: tuple[str, int] | None
    replicated_outputs: list[tuple[str, int]]
    grad_of: dict[str, tuple[str, int]]
    peak_steps: list[int]
    batch_size: int
    fx_nodes: dict[str, torch.fx.Node] = field(repr=False, default_factory=dict)
    per_rank_outputs: list[tuple[str, int]] = field(default_factory=list)  # split like the batch (backend)

    def resolve(self, node: torch.fx.Node) -> tuple[str, int] | None:
        """``(node, output index)`` an fx argument stands for (through getitem aliases), or None."""
        if node.name in self.aliases:
            return self.aliases[node.name]
        return (node.name, 0) if node.name in self.nodes else None

    def params(self) -> list[PNode]:
        return [n for n in self.nodes.values() if n.kind in ("param", "buffer")]

    def live_at(self, step: int) -> list[PNode]:
        """Non-state nodes whose outputs are live at schedule step ``step``."""
        return [n for n in self.nodes.values() if n.kind not in ("param", "buffer") and n.live[0] <= step <= n.live[1]]


def _shape_sig(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_shape_sig(x) for x in v) + ")"
    return type(v).__name__


def _const_sig(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return "%" + _shape_sig(a.meta.get("val"))  # inputs' shapes too: a broadcast add is another op
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_const_sig(x) for x in a) + "]"
    return repr(a)


def signature(node: torch.fx.Node, pins: Mapping[str, str] | None = None) -> str:
    """What ``node`` is, without where it is: op, constant args, input and output shapes/dtypes (two nodes with
    the same signature have the same candidate strategies, which are memoized by it); for a placeholder
    its role and name with layer indices replaced by ``#``; plus any user pin on it (so a pinned node never
    shares a class with an unpinned one)."""
    pin = (pins or {}).get(node.name, "")
    if node.op == "placeholder":
        fqn = gmeta.get_fqn(node) or ""
        return f"ph|{gmeta.get_role(node)}|{_LAYER_INDEX.sub('.#.', fqn)}|{_shape_sig(node.meta.get('val'))}|{pin}"
    return (f"{node.target}|{_const_sig(node.args)}|{_const_sig(sorted(node.kwargs.items()))}|"
            f"{_shape_sig(node.meta.get('val'))}|{pin}")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def layer_classes(gm: torch.fx.GraphModule, names: list[str], sig: Mapping[str, str], rounds: int = WL_ROUNDS
                  ) -> dict[str, str]:
    """node name -> class id by Weisfeiler-Lehman refinement of ``sig`` over inputs (in order) and users
    (as a sorted multiset) for ``rounds`` rounds, restricted to ``names``."""
    fx = {n.name: n for n in gm.graph.nodes}
    h = {n: _digest(sig[n]) for n in names}
    for _ in range(rounds):
        nh = {}
        for n in names:
            node = fx[n]
            ins = [h.get(a.name, a.name if a.op != "call_function" else "x") for _, a in tensor_args(node)]
            outs = sorted(h.get(u.name, "o") for u in node.users)
            nh[n] = _digest(h[n] + "|" + ",".join(ins) + "|" + ",".join(outs))
        h = nh
    return h


def _is_view(node: torch.fx.Node) -> bool:
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def _flops(node: torch.fx.Node, formulas: Mapping[Any, Callable]) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    formula = formulas.get(packet) if packet is not None else None
    if formula is None:
        return 0.0

    def shape_of(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return tuple(v.shape)
            if isinstance(v, (tuple, list)):
                return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in v)
        return a

    args = torch.fx.node.map_aggregate(node.args, shape_of)
    kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), shape_of)
    v = node.meta.get("val")
    out = tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(
        tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in v)
    try:
        return float(formula(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 -- a formula that cannot read these arguments counts 0, as FlopCounterMode would
        return 0.0


def _outputs(v: Any) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], str]:
    vals = v if isinstance(v, (tuple, list)) else (v,)
    nbytes = tuple(int(x.numel() * x.element_size()) if isinstance(x, torch.Tensor) else 0 for x in vals)
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else () for x in vals)
    dtype = next((str(x.dtype).removeprefix("torch.") for x in vals if isinstance(x, torch.Tensor)), "float32")
    return nbytes, shapes, dtype


def build_planning_graph(captured: CapturedGraph, cluster: Any, pins: Mapping[str, str] | None = None
                         ) -> PlanningGraph:
    """The :class:`PlanningGraph` of ``captured``, costed on ``cluster``'s slowest device.

    ``pins`` maps node names to a text that makes them a class of their own (user pins).
    """
    gm, _ = decompose_addmm(copy_graph_module(captured.gm), PassContext(axis_size=1, batch_size=captured.batch_size))
    devices = list({(d.kind, tuple(sorted(d.peak_flops.items())), d.memory_bandwidth_bytes_per_s,
                     op_overhead_s(d)): d for d in (cluster.device(r) for r in range(cluster.world_size))}.values())
    # one device per distinct set of figures: 1024 identical GPUs are costed once, not 1024 times
    formulas = compute_cost.flop_formulas()
    nodes: dict[str, PNode] = {}
    aliases: dict[str, tuple[str, int]] = {}
    order: list[str] = []
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            nbytes, shapes, _ = _outputs(node.meta["val"])
            role = gmeta.get_role(node)
            kind = {"param": "param", "buffer": "buffer", "batch": "batch"}[role]
            nodes[node.name] = PNode(node.name, kind, gmeta.get_fqn(node), nbytes, shapes, 0.0, 0.0, "")
            order.append(node.name)
        elif node.op == "call_function":
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
                    and node.args[0].name in nodes:
                aliases[node.name] = (node.args[0].name, int(node.args[1]))
                order.append(node.name)
                continue
            v = node.meta.get("val")
            if not isinstance(v, torch.Tensor) and not (isinstance(v, (tuple, list))
                                                      and any(isinstance(x, torch.Tensor) for x in v)):
                continue
            nbytes, shapes, dtype = _outputs(v)
            flops = _flops(node, formulas)
            moved = sum(int(a.meta["val"].numel() * a.meta["val"].element_size())
                        for _, a in tensor_args(node) if isinstance(a.meta.get("val"), torch.Tensor))
            moved = 0 if _is_view(node) else moved + sum(nbytes)
            cost = compute_cost.NodeCost(node.name, flops, moved, dtype)
            roof = max(float(compute_cost.node_time_s(cost, d)) - op_overhead_s(d) for d in devices)
            nodes[node.name] = PNode(node.name, "op", None, nbytes, shapes, roof,
                                     max(op_overhead_s(d) for d in devices), "")
            order.append(node.name)
    edges = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name not in nodes:
            continue
        for slot, (_, a) in enumerate(tensor_args(n)):
            src = aliases.get(a.name) or ((a.name, 0) if a.name in nodes else None)
            if src is not None:
                edges.append(Edge(src[0], src[1], n.name, slot))
    out = next(iter(gm.graph.find_nodes(op="output")))
    roles = gmeta.get_output_roles(out)
    flat = list(out.args[0])
    loss, replicated, grad_of, per_rank = None, [], {}, []
    param_by_fqn = {p.fqn: p.name for p in nodes.values() if p.kind in ("param", "buffer")}
    for role, a in zip(roles, flat):
        if not isinstance(a, torch.fx.Node):
            continue
        src = aliases.get(a.name) or ((a.name, 0) if a.name in nodes else None)
        if src is None:
            continue
        if role == "loss":
            loss = src
        elif role.startswith("grad:"):
            fqn = role.removeprefix("grad:")
            if fqn in param_by_fqn:
                grad_of[param_by_fqn[fqn]] = src
        elif role.startswith(gmeta.PER_RANK_ROLES):
            per_rank.append(src)
        else:
            replicated.append(src)
    _liveness(gm, nodes, aliases, order)
    sigs = {name: signature(fx_nodes[name], pins) for name in nodes}
    classes = layer_classes(gm, list(nodes), sigs)
    for name, pn in nodes.items():
        pn.signature = sigs[name]
        pn.layer_class = classes[name]
    pg = PlanningGraph(gm, nodes, order, edges, aliases, loss, replicated, grad_of, [], captured.batch_size, fx_nodes,
                       per_rank)
    pg.peak_steps = _peak_steps(pg)
    _split_classes_by_layer_parity(pg)
    return pg


def _split_classes_by_layer_parity(pg: PlanningGraph) -> None:
    """Append the parity of each node's layer to its class (module docstring): members of one class in even
    and in odd layers get separate decisions. Nodes without a layer (the batch), and graphs without a loss
    (nothing to tell forward from backward by), keep their classes."""
    if pg.loss is None:
        return
    from .layers import build_layers  # layers builds on this module

    layer_of = build_layers(pg).layer_of
    for name, pn in pg.nodes.items():
        if name in layer_of:
            pn.layer_class = f"{pn.layer_class}|{layer_of[name] % 2}"


def _liveness(gm: torch.fx.GraphModule, nodes: dict[str, PNode], aliases: dict[str, tuple[str, int]],
              order: list[str]) -> None:
    """Set each node's live interval: from its step to the last step that uses it or a view of it."""
    step = {name: i for i, name in enumerate(order)}
    end = len(order)
    base: dict[str, str] = {}  # view node -> the node whose storage it views
    last: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.name not in step and n.op != "output":
            continue
        i = step.get(n.name, end)
        for _, a in tensor_args(n) if n.op == "call_function" else [((0,), x) for x in n.all_input_nodes]:
            b = base.get(a.name, a.name)
            last[b] = max(last.get(b, 0), i)
        if n.op == "call_function" and _is_view(n):
            srcs = [a for _, a in tensor_args(n)]
            if srcs:
                base[n.name] = base.get(srcs[0].name, srcs[0].name)
    for name, pn in nodes.items():
        if pn.kind in ("param", "buffer", "batch"):
            pn.live = (0, end)
        elif name in base:
            pn.live = (step[name], step[name] - 1)  # a view holds no storage of its own
        else:
            pn.live = (step[name], max(last.get(name, step[name]), step[name]))


def _peak_steps(pg: PlanningGraph) -> list[int]:
    """The :data:`NUM_PEAK_STEPS` schedule steps with the most live non-state bytes (unsharded)."""
    n = len(pg.order)
    delta = [0] * (n + 2)
    for pn in pg.nodes.values():
        if pn.kind in ("param", "buffer") or pn.live[1] < pn.live[0]:
            continue
        delta[pn.live[0]] += sum(pn.out_bytes)
        delta[min(pn.live[1], n) + 1] -= sum(pn.out_bytes)
    total, curve = 0, []
    for i in range(n):
        total += delta[i]
        curve.append((total, i))
    return sorted(i for _, i in sorted(curve, key=lambda t: (-t[0], t[1]))[:NUM_PEAK_STEPS])
