"""Split a rank's joint program into the forward part and the backward part.

The torch.compile backend runs a training step in two calls: the forward when the model is called
(its outputs are needed right away), the backward at ``loss.backward()`` (when the outputs' gradients
exist). The forward part is exactly what the forward outputs need: every ancestor of an output whose
role is in ``forward_roles``. Everything else is the backward part, which reads the forward values it
needs as *saved* inputs (the forward part returns them after its outputs). Nothing is recomputed
that the forward computed, and nothing the forward does not need is computed early: a sharded
parameter's all_gather that only the backward uses (:mod:`adaptdist.passes.regather_in_backward`)
stays in the backward. Both parts keep the joint order of their nodes, so every rank issues its
collectives in the same order as the joint program did. This is the default partition of
``torch._functorch.partitioners`` (forward = what the outputs need, save the boundary), done on our
lowered graphs, whose collectives torch's partitioner does not know.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..program import SplitProgram


def split_forward_backward(gm: torch.fx.GraphModule, forward_roles: tuple[str, ...]) -> SplitProgram:
    """Split ``gm`` (module docstring); an output is a forward output when its role starts with one of
    ``forward_roles``. Values and shapes are unchanged: the parts compute exactly the joint program's
    outputs. ``gm``'s output node must carry output roles (:func:`adaptdist.graph_meta.set_output_roles`)."""
    graph = gm.graph
    out_node = graph.output_node()
    roles = gmeta.get_output_roles(out_node)
    outs = list(out_node.args[0])
    fw_idx = [j for j, r in enumerate(roles) if r.startswith(forward_roles)]
    bw_idx = [j for j in range(len(outs)) if j not in fw_idx]
    in_forward: set[torch.fx.Node] = set()
    stack = [outs[j] for j in fw_idx if isinstance(outs[j], torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in in_forward:
            continue
        in_forward.add(n)
        stack.extend(n.all_input_nodes)
    placeholders = list(graph.find_nodes(op="placeholder"))
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    needed_by_backward = _inputs_of([n for n in body if n not in in_forward])
    needed_by_backward.update(outs[j] for j in bw_idx if isinstance(outs[j], torch.fx.Node))
    saved = [n for n in graph.nodes if n in in_forward and n.op != "placeholder" and n in needed_by_backward]

    fw_graph, env = torch.fx.Graph(), {}
    fw_inputs = [i for i, p in enumerate(placeholders) if p in in_forward]
    for i in fw_inputs:
        env[placeholders[i]] = _copy(fw_graph, placeholders[i], env)
    for n in body:
        if n in in_forward:
            env[n] = _copy(fw_graph, n, env)
    fw_graph.output(tuple(env[outs[j]] if isinstance(outs[j], torch.fx.Node) else outs[j] for j in fw_idx)
                    + tuple(env[n] for n in saved))

    bw_graph, env = torch.fx.Graph(), {}
    for n in saved:
        env[n] = bw_graph.placeholder(f"saved_{n.name}")
        env[n].meta = dict(n.meta)
    bw_inputs = [i for i, p in enumerate(placeholders) if p in needed_by_backward]
    for i in bw_inputs:
        env[placeholders[i]] = _copy(bw_graph, placeholders[i], env)
    for n in body:
        if n not in in_forward:
            env[n] = _copy(bw_graph, n, env)
    bw_graph.output(tuple(env[outs[j]] if isinstance(outs[j], torch.fx.Node) else outs[j] for j in bw_idx))
    forward = torch.fx.GraphModule(gm, fw_graph)
    backward = torch.fx.GraphModule(gm, bw_graph)
    return SplitProgram(forward, backward, fw_inputs, bw_inputs, [roles[j] for j in fw_idx],
                        [roles[j] for j in bw_idx], len(saved))


def _inputs_of(nodes: list) -> set[torch.fx.Node]:
    out: set[torch.fx.Node] = set()
    for n in nodes:
        if isinstance(n, torch.fx.Node):
            out.update(n.all_input_nodes)
    return out


def _copy(graph: torch.fx.Graph, node: torch.fx.Node, env: dict) -> torch.fx.Node:
    new = graph.node_copy(node, lambda a: env[a])
    new.meta = dict(node.meta)
    return new


def drop_backward_outputs(split: SplitProgram, roles: tuple[str, ...]) -> SplitProgram:
    """``split`` with the backward part's outputs whose role is in ``roles`` removed, and what only they needed
    dropped from the backward (functional collectives included); its inputs (saved values,
    placeholders) are unchanged.

    Why: the torch.compile backend's joint program returns the capture's scalar "loss", ``sum_k <out_k,
    tangent_k>`` (:mod:`adaptdist.compiler.dynamo_capture`), which only made the export differentiate; its value
    is never read, yet under dp the backward computed it every step with a scalar all_reduce."""
    keep = [j for j, r in enumerate(split.backward_roles) if r not in roles]
    if len(keep) == len(split.backward_roles):
        return split
    gm = split.backward
    out = gm.graph.output_node()
    outs = list(out.args[0])
    out.args = (tuple(outs[j] for j in keep),)
    for n in list(gm.graph.nodes):  # every ones_like (the seed ones_like(loss) among them) reads only a shape: a constant
        v = n.meta.get("val")
        if (n.op == "call_function" and n.target is torch.ops.aten.ones_like.default and isinstance(v, torch.Tensor)
                and v.is_contiguous()):
            with gm.graph.inserting_before(n):
                ones = gm.graph.call_function(torch.ops.aten.full.default, (list(v.shape), 1),
                                              {"dtype": v.dtype, "device": v.device})
            ones.meta = dict(n.meta)
            n.replace_all_uses_with(ones)
            gm.graph.erase_node(n)
    for n in reversed(list(gm.graph.nodes)):
        # unused: pure ops, and functional collectives with their waits (fx counts them impure; they only return
        # a new tensor); an op that mutates an input (a shared-memory collective's out=) stays
        if n.op == "call_function" and not n.users and (
                not n.is_impure() or compat.functional_collective_kind(n.target) is not None):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return SplitProgram(split.forward, gm, split.forward_inputs, split.backward_inputs, split.forward_roles,
                        [split.backward_roles[j] for j in keep], split.num_saved)
