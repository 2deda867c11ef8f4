"""ModuleList experts in the torch.compile backend: one Dynamo graph's E per-expert subgraphs -> one batched call on
stacked ``[E, ...]`` parameters (issue 14, moe; the ``adaptdist train`` side is :mod:`.expert_lists`).

Dynamo inlines every expert's forward and lifts each expert's parameters into graph inputs
(``moe.experts.0.fc.weight``, ...); each node records the module it came from (``nn_module_stack``). A list is
recognised when its E experts' regions (the nodes under ``<prefix>.<i>``) are alike (the same ops in the same
order), read the same outside values (dense dispatch: every expert on the same tokens) besides their own
parameters, and each give one value to the rest of the graph. Then::

    linear_2 = linear(h, experts_0_fc_weight, experts_0_fc_bias); gelu = gelu(linear_2); linear_3 = linear(gelu, ...)
    ... (the same for experts 1 .. E-1) ...
    y = torch.stack([linear_3, linear_5, linear_7, linear_9])
  ->
    batched = self.moe_experts_batched(moe_experts_s_fc_weight, ..., h)    # [E, N, d]: all experts at once
    unbind = torch.unbind(batched); y = torch.stack([unbind[0], ..., unbind[3]])

``moe_experts_batched`` is region 0 under ``torch.vmap`` over the stacked parameters and the inputs expanded to
``[E, ...]``, traced to ATen ops once (``make_fx``), its ``bmm`` calls :func:`~.expert_batching.rank_bmm`
(which keeps the expert dim apart from the backend's rank dim). The stacked parameters are new graph inputs
(``moe.experts.*.fc.weight``) in place of the members; the backend builds each from its members' tensors (each
rank's held experts) and splits the stacked gradient back into each member's ``.grad``
(:class:`~adaptdist.runtime.compiled_step.CompiledStep`), so the user's parameters, optimizer, state dicts and
checkpoints keep their names. The ``stack(unbind(Y))`` left in the joint graph is folded by
:func:`.expert_lists.fold_stack_of_unbind`.

A list that is not recognised is left as it is (every rank holds every expert), with a one-line note saying why.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx

from .. import _torch_compat as compat
from .expert_batching import rank_bmm
from .expert_lists import STAR

_INDEXED = re.compile(r"\.(\d+)\.")


@dataclass
class StackedExperts:
    """What :func:`stack_dynamo_experts` did: ``origin[j]`` the Dynamo input index (or, for a stacked input, the
    member indices in expert order) of each new input ``j``; ``stacked`` {stacked name: member names}."""

    origin: list[Any] = field(default_factory=list)
    stacked: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _module_path(entry: Any) -> str:
    """``L['self'].moe.experts.0.fc`` (or ``L['self']._modules['moe']...``) -> ``moe.experts.0.fc``."""
    path = entry[0] if isinstance(entry, tuple) else str(entry)
    parts = re.findall(r"\._modules\['([^']+)'\]", path)
    if parts:
        return ".".join(parts)
    head, _, rest = path.partition("].")
    return rest if head.startswith("L[") else path


def _groups(inputs: list) -> dict[str, dict[int, dict[str, int]]]:
    """{prefix: {i: {rel name: input index}}} for every split of a parameter name at a numeric component."""
    out: dict[str, dict[int, dict[str, int]]] = {}
    for k, gi in enumerate(inputs):
        if gi.kind != "param" or gi.layout is not None or not gi.requires_grad:
            continue
        for m in _INDEXED.finditer(f".{gi.fqn}."):
            prefix, rel = f".{gi.fqn}."[1:m.start()], f".{gi.fqn}."[m.end():-1]
            if prefix and rel:
                out.setdefault(prefix, {}).setdefault(int(m.group(1)), {})[rel] = k
    return out


def _regions(gm: torch.fx.GraphModule, prefix: str, size: int) -> list[list[torch.fx.Node]]:
    regions: list[list[torch.fx.Node]] = [[] for _ in range(size)]
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        paths = {_module_path(v) for v in (n.meta.get("nn_module_stack") or {}).values()}
        for i in range(size):
            mine = f"{prefix}.{i}"
            if any(p == mine or p.startswith(mine + ".") for p in paths):
                regions[i].append(n)
                break
    return regions


def _why_not(gm, inputs, prefix: str, members: dict[int, dict[str, int]], phs: list) -> tuple[str, Any]:
    """("", details) when the list is recognised, else the reason."""
    size = len(members)
    if sorted(members) != list(range(size)) or size < 2:
        return "skip", None
    rels = list(members[0])
    if any(list(members[i]) != rels for i in members):
        return "skip", None
    if any(not inputs[members[0][rel]].global_shape for rel in rels):
        return "its experts have 0-dim parameters, which the backend cannot hold per rank", None
    for rel in rels:
        first = inputs[members[0][rel]]
        if any((inputs[members[i][rel]].global_shape, inputs[members[i][rel]].dtype)
               != (first.global_shape, first.dtype) for i in members):
            return "skip", None
    regions = _regions(gm, prefix, size)
    if any(not r for r in regions):
        return "skip", None
    own = [{phs[members[i][rel]] for rel in rels} for i in range(size)]
    inside = [set(r) for r in regions]
    ext, outs = [], []
    for i, region in enumerate(regions):
        e: list[torch.fx.Node] = []
        for n in region:
            for a in n.all_input_nodes:
                if a not in inside[i] and a not in own[i] and a not in e:
                    e.append(a)
        ext.append(e)
        outs.append([n for n in region if any(u not in inside[i] for u in n.users)])
        if any(u not in inside[i] for p in own[i] for u in p.users):
            return "its experts' parameters are also read outside the experts", None
    if any(len(o) != 1 for o in outs):
        return "an expert gives the rest of the model more than one value", None
    if any([n.target for n in r] != [n.target for n in regions[0]] for r in regions[1:]):
        return "its experts do not run the same ops", None
    if any(e != ext[0] for e in ext[1:]):
        return ("its experts read different inputs (each its own tokens); only dense dispatch, every expert on the "
                "same tokens weighted by the router's gates, is batched"), None
    return "", (rels, regions, ext[0], [o[0] for o in outs])


def _region_module(gm: torch.fx.GraphModule, region: list[torch.fx.Node], params: list[torch.fx.Node],
                   ext: list[torch.fx.Node], out: torch.fx.Node) -> torch.fx.GraphModule:
    """Region 0 as a GraphModule ``(params..., ext...) -> out``."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for k, n in enumerate(params + ext):
        env[n] = g.placeholder(f"in{k}")
        env[n].meta = dict(n.meta)
    for n in region:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return torch.fx.GraphModule(gm, g)


def _example(n: torch.fx.Node) -> torch.Tensor:
    return n.meta.get("example_value", n.meta.get("val"))


def _stacked_example(ph: torch.fx.Node, size: int) -> torch.Tensor:
    val = _example(ph)
    with compat.fake_tensor_mode(allow_constants=True):
        return torch.empty((size, *val.shape), dtype=val.dtype)


def _batched(sub: torch.fx.GraphModule, n_params: int, size: int, stacked_vals: list, ext_vals: list
             ) -> torch.fx.GraphModule:
    """``sub`` for all experts at once, traced to ATen ops on fake tensors, its ``bmm``\\ s :func:`rank_bmm`."""

    def all_experts(*xs):
        ps, ex = xs[:n_params], xs[n_params:]
        return torch.vmap(sub)(*ps, *[x.unsqueeze(0).expand(size, *x.shape) for x in ex])

    mode = compat.fake_tensor_mode(allow_constants=True)
    with mode:
        args = [torch.empty(v.shape, dtype=v.dtype) for v in list(stacked_vals) + list(ext_vals)]
        traced = compat.retrace_aten(all_experts, args)
    for n in traced.graph.nodes:
        if n.op == "call_function" and n.target == torch.ops.aten.bmm.default:
            n.target = rank_bmm
    traced.recompile()
    return traced


def stack_dynamo_experts(gm: torch.fx.GraphModule, inputs: list) -> tuple[torch.fx.GraphModule, list, StackedExperts]:
    """Rewrite every recognised expert list of Dynamo graph ``gm`` (module docstring). Returns the new graph, its
    inputs (:class:`~.dynamo_capture.GraphInput`, members replaced by one stacked input per parameter name,
    appended after the others) and a :class:`StackedExperts`; ``gm`` and ``inputs`` themselves when nothing is."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    found = StackedExperts()
    plans = []
    taken: set[int] = set()
    for prefix, members in sorted(_groups(inputs).items(), key=lambda kv: -len(kv[0])):
        if any(k in taken for m in members.values() for k in m.values()):
            continue
        why, details = _why_not(gm, inputs, prefix, members, phs)
        if why == "skip":
            continue
        if why:
            found.notes.append(f"{prefix} ({len(members)} identical modules) is not sharded as experts: {why}")
            continue
        plans.append((prefix, members, details))
        taken |= {k for m in members.values() for k in m.values()}
    batched = {}
    for prefix, members, (rels, regions, ext, outs) in list(plans):
        stacked_vals = [_stacked_example(phs[members[0][rel]], len(members)) for rel in rels]
        try:  # region 0 under vmap over the experts, traced once (an op without a vmap rule fails here)
            sub = _region_module(gm, regions[0], [phs[members[0][rel]] for rel in rels], ext, outs[0])
            batched[prefix] = _batched(sub, len(rels), len(members), stacked_vals, [_example(x) for x in ext])
        except Exception as e:
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            found.notes.append(f"{prefix} ({len(members)} identical modules) is not sharded as experts: running them "
                               f"batched failed ({why})")
            plans.remove((prefix, members, (rels, regions, ext, outs)))
            taken -= {k for m in members.values() for k in m.values()}
    if not plans:
        return gm, inputs, found
    import copy

    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # the caller's graph is Dynamo's: rewrite a copy
    phs = list(gm.graph.find_nodes(op="placeholder"))
    by_name = {n.name: n for n in gm.graph.nodes}
    new_inputs = [gi for k, gi in enumerate(inputs) if k not in taken]
    found.origin = [k for k in range(len(inputs)) if k not in taken]
    last = phs[-1]
    for prefix, members, (rels, regions, ext, outs) in plans:
        regions = [[by_name[n.name] for n in r] for r in regions]
        ext = [by_name[n.name] for n in ext]
        outs = [by_name[n.name] for n in outs]
        size = len(members)
        stacked_phs, stacked_vals = [], []
        for rel in rels:
            gi = inputs[members[0][rel]]
            name = f"{prefix}.{STAR}.{rel}"
            with gm.graph.inserting_after(last):
                ph = gm.graph.placeholder(re.sub(r"\W", "_", f"{prefix}_s_{rel}"))
            last = ph
            ph.meta["example_value"] = _stacked_example(phs[members[0][rel]], size)
            stacked_phs.append(ph)
            stacked_vals.append(ph.meta["example_value"])
            new_inputs.append(replace(gi, fqn=name, global_shape=(size, *gi.global_shape), source=""))
            found.origin.append([members[i][rel] for i in range(size)])
            found.stacked[name] = [inputs[members[i][rel]].fqn for i in range(size)]
        mod_name = re.sub(r"\W", "_", f"{prefix}_batched")
        gm.add_submodule(mod_name, batched[prefix])
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        anchor = max(ext + [last], key=order.__getitem__)  # after every input of the experts
        with gm.graph.inserting_after(anchor):
            y = gm.graph.call_module(mod_name, tuple(stacked_phs) + tuple(ext))
        with gm.graph.inserting_after(y):
            rows = gm.graph.call_function(torch.unbind, (y, 0))
        items = []
        for i in range(size):
            with gm.graph.inserting_after(items[-1] if items else rows):
                items.append(gm.graph.call_function(operator.getitem, (rows, i)))
        for o, item in zip(outs, items):
            o.replace_all_uses_with(item)
        for region in reversed(regions):
            for n in reversed(region):
                gm.graph.erase_node(n)
        for i in range(size):
            for rel in rels:
                gm.graph.erase_node(phs[members[i][rel]])
    gm.graph.lint()
    gm.recompile()
    return gm, new_inputs, found
