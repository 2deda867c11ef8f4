"""The captured step as a chain of layers, for the inter-stage planner (:mod:`.stages`).

A **layer** is a module of the model at the granularity a pipeline cuts at (:func:`layer_key`): the part of
a parameter's name through its first numeric index (``blocks.0``, ``layers.3``), else its module (``tok_emb``,
``ln_f``, ``fc1``); a tied alias (GPT's ``head.weight``) is no layer of its own. Layers are ordered by the
first forward use of their parameters; parameters no forward op reads make layers of their own at the end.
The model's own tensors (names without a dot, in a model with submodules: a rotary table, a cls token) are
no layer: each stage that reads one holds it (pp-core's ``shared_tensors``); they count with their first reader.
Where a node carries ``nn_module_stack`` (a capture that keeps it), its innermost module path is keyed
the same way (plus a dummy leaf); otherwise (today's ``aot_export_joint`` graphs have no
module stack) a forward node gets its layer from the parameters it consumes and from its inputs:

- **forward** nodes are the ancestors of the loss. In graph order, a node's layer is the *latest* layer
  among its parameters' layers and its inputs' layers (layers are numbered in the order their first
  parameter is consumed), so every forward edge goes from a layer to itself or a later one; a node with
  neither (``arange``) joins the earliest layer among its users.
- **backward** nodes (every other op) take the latest layer among the forward values and parameters
  they consume (the saved activations of their forward), else the earliest among their backward inputs
  (a gradient flowing down stays in its layer until it meets a forward value), else their users'.
- a backward node is **input-gradient** work (``B``, on the critical path of the pipeline) when one of
  its users is backward work of an earlier layer or input-gradient work of its own; the rest is
  **weight-gradient** work (``W``, what ZB-H1 defers; Qi et al. 2023, s.2).

Per layer: forward/backward/weight-gradient compute seconds (the planning graph's unsharded roofline
times, :mod:`.graph`), op counts (each pays the device's op overhead per microbatch), the bytes of F, B and W
work that do not shrink with the microbatch (:attr:`Layer.fixed_bytes`: a microbatch of any size reads the
whole weight and writes its whole gradient), parameter bytes
(trainable ones marked), the bytes of forward values it keeps for the backward, and per boundary the
bytes crossing it forward (activations computed from the batch: a value computed from parameters alone, a
rotary table's slice, is recomputed by the stage that needs it) and backward (gradients; a tied weight's
gradient parts are summed after the schedule, not sent), all for the whole batch.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Sequence


_INDEX = re.compile(r"^\d+$")


def layer_key(path: str) -> str:
    """The layer a parameter name belongs to: its module path through the first numeric component
    (``blocks.0.attn.q.weight`` -> ``blocks.0``, ``0.weight`` -> ``0``), else its module path (``tok_emb.weight``
    -> ``tok_emb``, ``model.norm.weight`` -> ``model.norm``); a name without dots is its own layer. The same
    names as pp-core's ``adaptdist.compiler.pipeline_lowering.layer_of``, so a plan's stage layer ranges are
    what the stage cut reads."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or path


@dataclass
class Layer:
    """One layer of the step (module docstring); times in seconds and sizes in bytes, for the whole batch.

    Attributes:
        name: its key (:func:`layer_key`). index: its position in the chain.
        forward, backward, weight: the planning graph's node names of each kind of work.
        forward_s, backward_s, weight_s: unsharded compute seconds of each.
        ops: dispatched ops of (forward, backward, weight) work (each pays the op overhead per microbatch).
        param_fqns: parameters whose layer this is. param_bytes: their bytes. trainable_bytes: those with
            a gradient.
        saved_bytes: forward values of this layer that the backward reads (kept per microbatch in flight).
        signature: a digest of its nodes' signatures: repeated blocks share it (and their stage costs).
        reads: parameters its forward consumes directly (of this layer or, tied, of another).
        fixed_bytes: (forward, input-gradient, weight-gradient) bytes its ops move that do not scale with the batch,
            as the compute model counts bytes (each distinct tensor argument read once, each output written once,
            views nothing: :mod:`adaptdist.cost_models.compute`): the arguments computed without the batch
            (parameters, buffers, their views and casts) and the outputs that hold a parameter's gradient (traced
            back from the gradient output through views and sums of the parameter's size to the ops computing it:
            the weight-gradient matmul, a tied weight's parts). The whole batch moves them once, each of ``m``
            microbatches again.
    """

    name: str
    index: int
    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    weight: list[str] = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0
    weight_s: float = 0.0
    ops: tuple[int, int, int] = (0, 0, 0)
    param_fqns: list[str] = field(default_factory=list)
    param_bytes: int = 0
    trainable_bytes: int = 0
    saved_bytes: int = 0
    signature: str = ""
    reads: set[str] = field(default_factory=set)
    fixed_bytes: tuple[int, int, int] = (0, 0, 0)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.weight_s


@dataclass
class LayerGraph:
    """The layers of a planning graph in forward order, and what crosses each boundary.

    Attributes:
        layers: the chain. layer_of: planning-graph node name -> layer index (ops and parameters).
        forward_bytes[i], backward_bytes[i]: bytes crossing the boundary after layer ``i`` in the forward
            (activations) and in the backward (gradients), whole batch (``len(layers) - 1`` entries).
        loss_layer: the layer that computes the loss.
    """

    pg: Any  # a .graph.PlanningGraph, not imported: graph.py builds layers for its layer-parity split
    layers: list[Layer]
    layer_of: dict[str, int]
    forward_bytes: list[int]
    backward_bytes: list[int]
    loss_layer: int

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def _digest(parts: Sequence[str]) -> str:
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=10).hexdigest()


def _module_key(fx: Any) -> str | None:
    stack = fx.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return layer_key(path + ".x") if path else None


def build_layers(pg: Any) -> LayerGraph:
    """Group ``pg``'s nodes (a :class:`.graph.PlanningGraph`) into layers (module docstring).

    Raises:
        InternalError: the graph has no loss (cannot tell forward from backward).
    """
    from ...errors import InternalError

    if pg.loss is None:
        raise InternalError("the planning graph has no loss output; cannot tell forward from backward")
    fx = pg.fx_nodes
    names = [n for n in pg.order if n in pg.nodes]
    base = {n: pg.aliases[n][0] for n in pg.order if n in pg.aliases}

    def src(a_name: str) -> str | None:
        s = base.get(a_name, a_name)
        return s if s in pg.nodes else None

    inputs: dict[str, list[str]] = {}
    users: dict[str, list[str]] = {n: [] for n in names}
    for n in names:
        node = fx[n]
        ins = []
        for a in node.all_input_nodes:
            s = src(a.name)
            if s is not None and s != n:
                ins.append(s)
        inputs[n] = list(dict.fromkeys(ins))
        for s in inputs[n]:
            users[s].append(n)
    forward: set[str] = set()
    stack = [pg.loss[0]]
    while stack:
        n = stack.pop()
        if n in forward:
            continue
        forward.add(n)
        stack.extend(inputs.get(n, []))
    order: dict[str, int] = {}
    param_layer: dict[str, int] = {}

    def key_index(key: str) -> int:
        if key not in order:
            order[key] = len(order)
        return order[key]

    fqns = [p.fqn or p.name for p in pg.params()]
    shared = {f for f in fqns if "." not in f} if any("." in f for f in fqns) else set()  # the model's own tensors
    layer: dict[str, int | None] = {}
    for n in names:  # forward, graph order
        pn = pg.nodes[n]
        if pn.kind in ("param", "buffer", "batch") or n not in forward:
            continue
        cands = []
        mk = _module_key(fx[n])
        if mk is not None:
            cands.append(key_index(mk))
        for s in inputs[n]:
            ps = pg.nodes[s]
            if ps.kind in ("param", "buffer"):
                if (ps.fqn or s) in shared:
                    continue  # a rotary table, a cls token: held by each stage using it, no layer of its own
                if s not in param_layer:
                    param_layer[s] = key_index(layer_key(ps.fqn or s))
                cands.append(param_layer[s])
            elif layer.get(s) is not None:
                cands.append(layer[s])
        param_view = pn.live[1] < pn.live[0] and inputs[n] and all(pg.nodes[s].kind in ("param", "buffer")
                                                                      for s in inputs[n])
        layer[n] = None if param_view else (max(cands) if cands else None)  # t(W): where it is read
    for n in reversed(names):  # forward nodes with no layered input join their earliest user
        if n in layer and layer[n] is None:
            us = [layer[u] for u in users[n] if layer.get(u) is not None]
            layer[n] = min(us) if us else 0
    if not order:
        order["model"] = 0
    for p in pg.params():  # the model's own tensors count with the first layer that reads them
        if (p.fqn or p.name) in shared:
            us = [layer[u] for u in users[p.name] if u in forward and layer.get(u) is not None]
            param_layer[p.name] = min(us) if us else 0
    readers: dict[str, set[int]] = {}  # placeholder -> layers whose forward reads it (two for a tied weight)
    for n in names:
        if n in forward and pg.nodes[n].kind == "op" and layer.get(n) is not None:
            for s in inputs[n]:
                if pg.nodes[s].kind != "op":
                    readers.setdefault(s, set()).add(layer[n])
    fusers: dict[str, set[int]] = {}  # forward value -> layers whose forward reads it
    for n in names:
        if n in forward and pg.nodes[n].kind == "op" and layer.get(n) is not None:
            for s in inputs[n]:
                fusers.setdefault(s, set()).add(layer[n])
    for n in names:  # backward
        pn = pg.nodes[n]
        if pn.kind != "op" or n in forward:
            continue
        own = [layer[s] for s in inputs[n] if s in forward and layer.get(s) is not None]
        cands = set(own)
        for s in inputs[n]:
            if s in forward and layer.get(s) is not None:
                cands |= fusers.get(s, set())  # a saved value is its layer's, or the input of a later one
            elif pg.nodes[s].kind != "op":
                cands |= readers.get(s, {param_layer[s]} if s in param_layer else set())
        bwd = [layer[s] for s in inputs[n] if layer.get(s) is not None and s not in forward]
        if cands and bwd:  # the latest layer the saved values may be of, at or before the incoming gradient's
            below = [c for c in cands if c <= min(bwd)]
            layer[n] = max(below) if below else min(cands)
        elif cands:
            layer[n] = max(own) if own else max(cands)
        else:
            layer[n] = min(bwd) if bwd else None
    last = len(order) - 1
    for n in reversed(names):
        if n in layer and layer[n] is None:
            us = [layer[u] for u in users[n] if layer.get(u) is not None]
            layer[n] = min(us) if us else last
    for src_name, _ in pg.grad_of.values():  # a tied weight's gradient parts are summed after the schedule:
        ins = [layer[s] for s in inputs.get(src_name, []) if layer.get(s) is not None]  # the sum is no send
        if src_name in layer and len(set(ins)) > 1 and getattr(fx[src_name].target, "__name__", "") == "add.Tensor" \
                and all(u.op == "output" for u in fx[src_name].users):
            layer[src_name] = max(ins)
    for p in pg.params():  # parameters never consumed by a forward op: the layer of their name (last if new)
        if p.name not in param_layer and (p.fqn or p.name) not in shared:
            param_layer[p.name] = key_index(layer_key(p.fqn or p.name))
    keys = sorted(order, key=order.get)
    layers = [Layer(k, i) for i, k in enumerate(keys)]
    # input-gradient (B) vs weight-gradient (W) work, in reverse graph order
    feeds: dict[str, bool] = {}
    for n in reversed(names):
        if n in forward or pg.nodes[n].kind != "op":
            continue
        feeds[n] = any(u not in forward and pg.nodes[u].kind == "op" and
                       (layer[u] < layer[n] or (layer[u] == layer[n] and feeds.get(u, False))) for u in users[n])
    ops = [[0, 0, 0] for _ in layers]
    sigs: list[list[str]] = [[] for _ in layers]
    for n in names:
        pn = pg.nodes[n]
        if pn.kind != "op":
            continue
        L = layers[layer[n]]
        if n in forward:
            L.forward.append(n)
            L.forward_s += pn.roof_s
            kind = 0
        elif feeds.get(n):
            L.backward.append(n)
            L.backward_s += pn.roof_s
            kind = 1
        else:
            L.weight.append(n)
            L.weight_s += pn.roof_s
            kind = 2
        ops[layer[n]][kind] += 1
        sigs[layer[n]].append(f"{kind}|{pn.signature}")
    for i, L in enumerate(layers):
        L.ops = tuple(ops[i])  # type: ignore[assignment]
    for p in pg.params():
        L = layers[param_layer.get(p.name, 0)]
        L.param_fqns.append(p.fqn or p.name)
        L.param_bytes += sum(p.out_bytes)
        if p.name in pg.grad_of:
            L.trainable_bytes += sum(p.out_bytes)
        sigs[L.index].append(f"p|{p.signature}")
    layer_of = {n: v for n, v in layer.items() if v is not None}
    layer_of.update(param_layer)
    storage_users = {n: list(users[n]) for n in names}  # a view's users use its base's storage
    for n in names:
        pn = pg.nodes[n]
        if pn.kind == "op" and pn.live[1] < pn.live[0]:
            root = n
            seen = 0
            while root in pg.nodes and pg.nodes[root].kind == "op" and pg.nodes[root].live[1] < pg.nodes[root].live[0] \
                    and inputs.get(root) and seen < 64:
                root, seen = inputs[root][0], seen + 1
            if root != n and root in storage_users:
                storage_users[root].extend(users[n])
    weight_work = {n for L in layers for n in L.weight}
    for n in names:  # parameters each layer's forward reads (a tied weight: by two layers)
        if n in forward and pg.nodes[n].kind == "op":
            for s in inputs[n]:
                if s in param_layer:
                    layers[layer[n]].reads.add(pg.nodes[s].fqn or s)
    batch_dep: set[str] = set()  # values computed from the batch: what a stage must receive (the rest it recomputes)
    for n in names:
        if pg.nodes[n].kind == "batch" or any(x in batch_dep for x in inputs[n]):
            batch_dep.add(n)
    nb = len(layers)
    fwd_cross = [0] * max(nb - 1, 0)
    bwd_cross = [0] * max(nb - 1, 0)
    for n in names:
        pn = pg.nodes[n]
        if pn.kind != "op" or pn.live[1] < pn.live[0]:  # views hold no storage of their own
            continue
        lp = layer[n]
        nbytes = sum(pn.out_bytes)
        if n in forward:
            uses = [layer_of[u] for u in storage_users[n] if u in layer_of]
            lc = max(uses, default=lp)
            for b in range(lp, lc if n in batch_dep else lp):
                fwd_cross[b] += nbytes
            if any(u not in forward for u in storage_users[n]):
                layers[lp].saved_bytes += nbytes
        else:
            if n in weight_work:  # a tied weight's gradient part: summed after the schedule, not sent
                continue
            uses = [layer_of[u] for u in storage_users[n] if u in layer_of]
            lc = min(uses, default=lp)
            for b in range(lc, lp):
                bwd_cross[b] += nbytes
    _fixed_bytes(pg, layers, inputs, forward, batch_dep)
    for i, L in enumerate(layers):
        L.signature = _digest(sorted(sigs[i]))
    return LayerGraph(pg, layers, layer_of, fwd_cross, bwd_cross, layer[pg.loss[0]] or 0)


def _fixed_bytes(pg: Any, layers: Sequence[Layer], inputs: dict[str, list[str]], forward: set[str],
                 batch_dep: set[str]) -> None:
    """Fill each layer's :attr:`Layer.fixed_bytes` (its docstring): per op (not views), the bytes of its arguments
    computed without the batch plus those of its outputs that are a parameter's gradient."""
    import operator

    import torch

    from ...passes.sharding_rules import tensor_args

    def _is_view(node: Any) -> bool:  # graph.py's test (graph imports this module, so not from there)
        return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))

    grads: set[str] = set()
    for p, (src, _) in pg.grad_of.items():
        size = sum(pg.nodes[p].out_bytes)
        todo = [src]
        while todo:
            n = todo.pop()
            if n in grads or n in forward or n not in pg.nodes or pg.nodes[n].kind != "op" \
                    or sum(pg.nodes[n].out_bytes) != size:
                continue
            grads.add(n)
            node = pg.fx_nodes[n]
            # back through views and sums of gradient parts (a tied weight) to the ops that computed them, no further:
            # an activation may happen to have the weight's size
            if _is_view(node) or getattr(node.target, "__name__", "") == "add.Tensor":
                todo.extend(inputs.get(n, []))
    base = {n: a[0] for n, a in pg.aliases.items()}
    for L in layers:
        out = [0, 0, 0]
        for phase, names in enumerate((L.forward, L.backward, L.weight)):
            for n in names:
                node = pg.fx_nodes[n]
                if _is_view(node):
                    continue
                seen: set[str] = set()
                for _, a in tensor_args(node):
                    v = a.meta.get("val")
                    if a.name in seen or not isinstance(v, torch.Tensor):
                        continue
                    seen.add(a.name)
                    if base.get(a.name, a.name) not in batch_dep:
                        out[phase] += int(v.numel() * v.element_size())
                if n in grads or n not in batch_dep:
                    out[phase] += sum(pg.nodes[n].out_bytes)
        L.fixed_bytes = (out[0], out[1], out[2])
