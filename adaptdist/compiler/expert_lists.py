"""Experts written as an ``nn.ModuleList`` of MLPs, captured as one stacked ``[E, ...]`` weight per parameter
(issue 14, moe: expert parallelism for ModuleList experts).

A ModuleList of experts has no expert dim: ``experts.0.fc.weight`` ... ``experts.3.fc.weight`` are four
parameters, each expert's matmuls are its own nodes, so no placement can put different experts on different
ranks. Stacked experts (``w_in: [E, d, h]``, batched matmuls) have one: ``Shard(0)`` on the ``ep`` mesh axis holds
``E / ep`` experts per rank and the existing lowering moves the tokens by all_to_all
(:mod:`.expert_batching`, tests/test_moe.py). This module turns the first form into the second at capture, so
everything after capture (planner, ``--plan ep``, lowering, checkpoints of the stacked value) is the stacked
form's machinery.

Design (chosen over rewriting the joint graph after capture, where the E per-expert backward chains would have
to be recognised and re-batched too): the rewrite happens *before* autograd traces the step, at the module level,
so the backward of the batched form is autograd's own:

1. :func:`find_expert_lists`: candidate ``nn.ModuleList``\\ s whose E >= 2 children are structurally identical
   (same class and ``repr``, the same parameter names, shapes and dtypes, all trainable, no buffers, no
   parameter shared with another module).
2. :func:`probe_expert_lists`: one forward of the step on fake tensors with a hook on every candidate child. A list
   is recognised when each of its experts is called exactly once, with positional tensor arguments only, and all
   of them with the *same* tensors (dense dispatch: every expert on every token, weighted by the router's
   zero-masked gates, as in ``adaptdist/models/moe.py``). A transformer's ``layers`` list fails this (layer i+1
   reads layer i's output, seen in the autograd graph at layer 1's call, where the probe stops when every
   candidate is such a chain) and is left alone silently; so is a list whose experts get their own token slices,
   with a one-line reason (:attr:`ExpertLists.notes`: ``adaptdist plan`` / ``explain`` print it).
3. During the export, each recognised list's parameters are registered once, stacked: ``<prefix>.*.<name>``
   (``moe.experts.*.fc.weight: [E, hidden, d]``, expert i at index i), and each expert's ``forward`` is replaced
   (for the trace only) by :class:`_BatchedExperts`: the first expert called computes all E experts at once with
   ``torch.vmap`` over the stacked parameters and the input expanded to ``[E, ...]`` (``F.linear`` becomes
   ``bmm(x [E, N, d], W^T [E, d, h])``, the stacked form's op), and expert i returns row i of that result
   (``unbind``); an expert's parameter read outside its forward is its row of the stacked one. If the batched
   export fails (an op without a vmap rule, dropout inside an expert: vmap refuses random ops), the step is
   exported again with the list as it is, and a note says why. The user's ``torch.stack([e(x) for e in experts])``
   then reads ``stack(unbind(Y))``, which
   :func:`fold_stack_of_unbind` folds back to ``Y`` in the joint graph (the same pattern appears in the backward
   for ``stack``'s gradient), so the expert dim runs from the weights to the combine with nothing in between.

Numerics: each expert computes exactly its own MLP on the same inputs (the batched matmul multiplies the same
numbers, grouped per expert), autograd sums each expert's gradient into its row of the stacked gradient; an
expert no token picks gets a zero gate weight everywhere, so exactly zero gradient, as in eager.

Names: :attr:`CapturedGraph.stacked` maps each stacked name to the E user names in order; the initial state
is stacked from the model (:func:`stack_state`) and ``model.safetensors`` / ``full_state_dict`` unstack it
(:func:`unstack_state`), so the user's names (``moe.experts.3.fc.weight``) are what a user reads back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
import torch.nn as nn

from .. import _torch_compat as compat

STAR = "*"  # the expert index in a stacked name: moe.experts.*.fc.weight


@dataclass(frozen=True)
class ExpertList:
    """A recognised ModuleList of E identical experts: ``prefix`` (``model.moe.experts``, from the captured step),
    ``names`` the parameter names relative to one expert (``fc.weight``, ...), in registration order."""

    prefix: str
    size: int
    names: tuple[str, ...]

    def stacked_name(self, rel: str) -> str:
        return f"{self.prefix}.{STAR}.{rel}"

    def member_names(self, rel: str) -> list[str]:
        return [f"{self.prefix}.{i}.{rel}" for i in range(self.size)]


@dataclass
class ExpertLists:
    """What :func:`probe_expert_lists` found: the recognised lists and a one-line note per rejected candidate."""

    lists: list[ExpertList] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def stacked(self, strip: int = 0) -> dict[str, list[str]]:
        """{stacked name: [member names, expert order]}, the first ``strip`` characters of each dropped."""
        return {el.stacked_name(r)[strip:]: [m[strip:] for m in el.member_names(r)] for el in self.lists
                for r in el.names}


def _signature(m: nn.Module) -> tuple:
    return (type(m), repr(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()))


def find_expert_lists(root: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """``(prefix, list)`` for every ``nn.ModuleList`` under ``root`` whose children (at least 2) are structurally
    identical trainable modules without buffers, none of whose parameters is registered anywhere else."""
    owners: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for prefix, mod in root.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        children = list(mod)
        sig = _signature(children[0])
        if not sig[2] or any(_signature(c) != sig for c in children[1:]):
            continue
        if any(True for c in children for _ in c.buffers()):
            continue
        if not all(rg for *_, rg in sig[2]) or len({id(c) for c in children}) != len(children):
            continue
        if any(owners[id(p)] != 1 for c in children for p in c.parameters()):
            continue
        out.append((prefix, mod))
    return out


def probe_expert_lists(step: nn.Module, batch: tuple, strip: int = 0) -> ExpertLists:
    """Run ``step(*batch)`` once (on fake tensors: cheap) watching every candidate list's experts (module
    docstring, step 2); ``strip``: characters of each prefix dropped in the notes (``model.``)."""
    found = ExpertLists()
    candidates = find_expert_lists(step)
    if not candidates:
        return found
    calls: dict[int, list[tuple[tuple, dict]]] = {}
    outputs: dict[int, list[Any]] = {}
    chained: set[str] = set()
    handles = []
    for prefix, mod in candidates:
        for i, child in enumerate(mod):
            def pre(m, args, kwargs, _key=id(child), _i=i, _prefix=prefix, _mod=mod):
                calls.setdefault(_key, []).append((args, kwargs))
                if _i == 1 and _prefix not in chained and _chained(
                        [calls.get(id(_mod[0]), []), calls[_key]], [outputs.get(id(_mod[0]), [])]):
                    chained.add(_prefix)
                    if len(chained) == len(candidates):
                        raise _Decided  # every list is a chain of layers: the rest of the forward tells nothing

            def post(m, args, out, _key=id(child)):
                outputs.setdefault(_key, []).append(out)
            handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(child.register_forward_hook(post))
    try:
        step(*batch)  # with autograd: its graph tells a chain of layers from experts on their own inputs
    except _Decided:
        return found
    except Exception:  # the export reports the model's own failure; nothing is recognised
        return found
    finally:
        for h in handles:
            h.remove()
    for prefix, mod in candidates:
        if prefix in chained:
            continue  # a transformer's layers, one after another: not experts, nothing to say
        name = prefix[strip:]
        seen = [calls.get(id(c), []) for c in mod]
        why = _why_not_experts(seen)
        if why is None:
            rel = tuple(n for n, _ in mod[0].named_parameters())
            found.lists.append(ExpertList(prefix, len(mod), rel))
        elif why:
            found.notes.append(f"{name} ({len(mod)} identical modules) is not sharded as experts: {why}")
    return found


class _Decided(Exception):
    """Raised by the probe's hook to stop the forward once every candidate list is known to be a chain."""


def _chained(seen: list[list[tuple[tuple, dict]]], outs: list[list[Any]], budget: int = 256) -> bool:
    """Whether module 1's (first) input is computed from module 0's (first) output (found within ``budget``
    autograd nodes)."""
    if len(seen) < 2 or not seen[0] or not seen[1] or not outs or not outs[0]:
        return False
    targets = {t.grad_fn for t in compat.tree_leaves(outs[0][0])
               if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = [a.grad_fn for a in compat.tree_leaves((seen[1][0][0], seen[1][0][1]))
            if isinstance(a, torch.Tensor) and a.grad_fn is not None]
    visited: set = set()
    while todo and len(visited) < budget:
        fn = todo.pop()
        if fn in targets:
            return True
        if fn in visited:
            continue
        visited.add(fn)
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return False


def _why_not_experts(seen: list[list[tuple[tuple, dict]]]) -> str | None:
    """None when every module was called once with the same positional tensors, else the reason."""
    if any(len(s) == 0 for s in seen) and all(len(s) <= 1 for s in seen):
        idle = [i for i, s in enumerate(seen) if not s]
        return f"module(s) {idle} are never called in the step"
    if any(len(s) != 1 for s in seen):
        return f"each is called {sorted({len(s) for s in seen})} times (an expert list's modules are called once each)"
    args0 = seen[0][0][0]
    if any(s[0][1] for s in seen):
        return "its modules are called with keyword arguments"
    if not args0 or not all(isinstance(a, torch.Tensor) for a in args0):
        return "its modules take non-tensor arguments"
    if any(len(s[0][0]) != len(args0) or any(a is not b for a, b in zip(s[0][0], args0)) for s in seen[1:]):
        return ("its modules receive different inputs (each its own tokens); only dense dispatch, every expert on "
                "the same tokens weighted by the router's gates, is batched")
    return None


class _BatchedExperts:
    """The forward of expert ``index`` of a recognised list during the trace: all E experts computed once (the
    first call), with ``torch.vmap`` over the stacked parameters; expert ``index`` returns its row."""

    def __init__(self, template: nn.Module, stacked: dict[str, torch.Tensor], size: int, cache: dict, index: int):
        self.template, self.stacked, self.size, self.cache, self.index = template, stacked, size, cache, index

    def __call__(self, *args):
        key = tuple(id(a) for a in args)
        if self.cache.get("key") != key:
            self.cache["key"] = key
            self.cache["rows"] = self._all(args)
        return self.cache["rows"][self.index]

    def _all(self, args: tuple) -> list:
        template, forward = self.template, type(self.template).forward

        def one(params, *xs):
            with compat.reparametrize(template, params):
                return forward(template, *xs)

        expanded = [a.unsqueeze(0).expand(self.size, *a.shape) for a in args]  # the stacked form's xe [E, N, d]
        out = torch.vmap(one)(self.stacked, *expanded)
        if isinstance(out, torch.Tensor):
            return list(out.unbind(0))
        flat, spec = compat.tree_flatten(out)  # a tuple or dict of outputs: each expert gets its rows of each
        per = [t.unbind(0) for t in flat]
        return [compat.tree_unflatten([p[i] for p in per], spec) for i in range(self.size)]


@contextlib.contextmanager
def batched_experts(step: nn.Module, lists: list[ExpertList], stacked: dict[str, torch.Tensor]) -> Iterator[None]:
    """For the trace: every recognised expert's ``forward`` is :class:`_BatchedExperts` over ``stacked``
    ({stacked name: the traced ``[E, ...]`` tensor}); restored on exit."""
    saved = []
    try:
        for el in lists:
            mod = step.get_submodule(el.prefix)
            params = {r: stacked[el.stacked_name(r)] for r in el.names}
            cache: dict[str, Any] = {}
            for i, child in enumerate(mod):
                saved.append((child, child.__dict__.get("forward")))
                child.forward = _BatchedExperts(mod[0], params, el.size, cache, i)
        yield
    finally:
        for child, fwd in reversed(saved):
            if fwd is None:
                del child.forward
            else:
                child.forward = fwd


def _row_of(item: Any) -> tuple[torch.fx.Node, int, int] | None:
    """``(Y, dim, i)`` when ``item`` is ``unbind(Y, dim)[i]`` or ``select(Y, dim, i)``, else None."""
    import operator

    aten = torch.ops.aten
    if not isinstance(item, torch.fx.Node) or item.op != "call_function":
        return None
    if item.target == aten.select.int:
        return item.args[0], item.args[1], item.args[2]
    src = item.args[0] if item.target == operator.getitem else None
    if isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target == aten.unbind.int:
        return src.args[0], src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0), item.args[1]
    return None


def fold_stack_of_unbind(gm: torch.fx.GraphModule) -> bool:
    """``stack([unbind(Y, d)[0], ..., unbind(Y, d)[E-1]], d)`` -> ``Y`` (the same values), and the same with
    ``select(Y, d, i)`` rows: the user's ``torch.stack`` of the experts' rows, and in the backward the stack of
    its gradient's rows. Returns whether it changed.

    Before/after (E = 4, ``Y: [4, N, d]``)::

        unbind = aten.unbind.int(Y, 0); r0 = unbind[0]; ...; r3 = unbind[3]
        stack = aten.stack.default([r0, r1, r2, r3])            # [4, N, d]
        ->  (uses of stack read Y)
    """
    aten = torch.ops.aten
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != aten.stack.default:
            continue
        items = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        rows = [_row_of(i) for i in items]
        if not rows or any(r is None for r in rows):
            continue
        y = rows[0][0]
        val = y.meta.get("val")
        if val is None or dim < 0 or any(r[0] is not y or r[1] != dim or r[2] != k for k, r in enumerate(rows)):
            continue
        if val.shape[dim] != len(items) or tuple(val.shape) != tuple(n.meta["val"].shape):
            continue
        n.replace_all_uses_with(y)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def expert_lines(stacked: dict[str, list[str]], notes: list[str]) -> list[str]:
    """What ``adaptdist plan`` / ``explain`` print about ModuleList experts: one line per recognised list (its
    stacked names) and each note of a list of identical modules left as it is."""
    lists: dict[str, list[str]] = {}
    for s, members in stacked.items():
        prefix = s.split(f".{STAR}.")[0]
        lists.setdefault(prefix, []).append(s)
    out = [f"experts {p}: {len(stacked[names[0]])} ModuleList experts held stacked on their expert dim as "
           f"{', '.join(names)} (an ep axis or the planner places them per rank; weights saved under their own "
           "names)" for p, names in lists.items()]
    return out + [f"note: {n}" for n in notes]


def stack_state(named: dict[str, torch.Tensor], stacked: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The stacked values ``{stacked name: torch.stack(members)}`` from a model's ``named`` tensors."""
    return {s: torch.stack([named[m].detach() for m in members]) for s, members in stacked.items()}
