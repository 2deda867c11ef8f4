"""Op coverage on torch's OpInfo database: one op's float32 CPU sample, captured, lowered and simulated.

Used by ``tests/test_opinfo_sweep.py`` (a fixed sample of ops) and ``benchmarks/bench_opinfo.py`` (all ops).

For one sample ``op(input, *args, **kwargs)`` the tensor leaves become the inputs of a step whose loss is
``sum_k <out_k, t_k>`` over the op's floating-point outputs with random tangents ``t_k`` that require grad:
the gradient of a tangent is the op's output (the forward is checked), the gradients of the op's inputs are
its vector-Jacobian product (the backward is checked, for ops with autograd). Two settings:

``batch``: a batch split. The tensor leaves whose dim 0 equals the first input's (and tangents of outputs
    whose dim 0 does) are batch inputs, split on dim 0 over the ranks; the others are replicated parameters
    (integer ones: buffers). Counted as *lowered* only if no rank issues an all_gather (params are
    replicated here, so any all_gather gathers the batch).
``other``: the first input (a parameter) sharded on its last dim of size >= 3 other than dim 0, everything
    else replicated and no batch
    split; any collective is allowed, the values must match.

Each run ends in one category:
    ``supported``  lowered (no batch gather) and equal to eager (outputs and gradients, 1e-4 relative)
    ``gathers``    equal to eager but some rank gathers the batch (not lowered)
    ``refused``    an :class:`~adaptdist.errors.UnsupportedOpError` naming the op
    ``xfail``      an expected failure, with its reason: no float32 CPU sample, the sample fails eagerly, a
                   random op, not capturable (CaptureError / export failure: data-dependent shapes, ...)
    ``bug``        a wrong value, or a crash with any other exception (InternalError included)
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn

from adaptdist import _torch_compat as compat
from adaptdist import graph_meta as gmeta
from adaptdist.errors import AdaptdistError, CaptureError, UnsupportedOpError

CATEGORIES = ("supported", "gathers", "refused", "xfail", "bug")
SETTINGS = ("batch", "other")
RTOL = 1e-4
ATOL = 1e-4


def op_key(op: Any) -> str:
    """``name`` or ``name.variant`` of an OpInfo entry (unique in op_db)."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def ops_by_key() -> dict[str, Any]:
    return {op_key(op): op for op in compat.opinfo_db()}


@dataclasses.dataclass
class Outcome:
    category: str
    reason: str = ""
    collectives: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"category": self.category, "reason": self.reason, "collectives": list(self.collectives)}


def _leaves(sample: Any) -> tuple[list[Any], Any]:
    return compat.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def pick_sample(op: Any, max_numel: int = 2048, tries: int = 12, independent_first: bool = True) -> Any | None:
    """One of the op's first ``tries`` float32 CPU samples whose input is a tensor (or a list of them) with
    dim 0 of size >= 3 and whose tensors hold at most ``max_numel`` elements each; None if none is.

    Preferred, in order: a sample on which the op keeps samples independent (:func:`independent_samples`:
    dim 0 is a batch there, as under DDP; with ``independent_first``), whose input has at least 2 dims and
    whose other tensors with that dim 0 have as many dims (a ``(5,)`` broadcast against a ``(5, 1)`` would
    be split on the dim it broadcasts along), none of them empty; then such a sample on which the op mixes samples; then one of
    2 dims; then the first. Where no sample has dim 0 >= 3, :func:`_tiled_sample`."""
    if torch.float32 not in op.supported_dtypes("cpu"):
        return None
    ranked = []
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=bool(op.supports_autograd))
        for i, s in enumerate(samples):
            if i >= tries:
                break
            first = s.input[0] if isinstance(s.input, (list, tuple)) and s.input else s.input
            if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] < 3:
                continue
            leaves, _ = _leaves(s)
            if all(t.numel() <= max_numel for t in leaves if isinstance(t, torch.Tensor)):
                aligned = all(t.dim() == first.dim() for t in leaves
                              if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == first.shape[0])
                aligned = aligned and all(t.numel() > 0 for t in leaves if isinstance(t, torch.Tensor))
                ranked.append(((first.dim() >= 2) + (first.dim() >= 2 and aligned), i, s))
    except Exception:
        pass
    if not ranked:
        return _tiled_sample(op, max_numel, tries)
    ranked.sort(key=lambda r: (-r[0], r[1]))
    if independent_first:
        for score, _, s in ranked:
            if score == 2 and independent_samples(op, s):
                return s
        tiled = _tiled_sample(op, max_numel, tries, min_dim=3, independent=True)
        if tiled is not None:  # a batch of matrices ([2, 5, 5] -> [4, 5, 5]) where dim 0 of the others is a row
            return tiled
    return ranked[0][2]


def _tiled_sample(op: Any, max_numel: int, tries: int, min_dim: int = 1, independent: bool = False) -> Any | None:
    """Where every sample's dim 0 is 1 or 2 (``layer_norm``'s, ``cross_entropy``'s): the first such sample
    (of at least 2 dims first) that still runs eagerly with its tensors of that dim 0 repeated along dim 0
    to 4 rows (a batch of copies of the sample's rows, so that 3 ranks each get some). Only samples whose
    first input has at least ``min_dim`` dims and no empty tensor (``linalg.*``'s batches of 2 matrices,
    where the samples of dim 0 >= 3 are single matrices), and with ``independent`` only one on which the op
    keeps samples independent (:func:`independent_samples`)."""
    found = []
    try:
        for i, s in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=bool(op.supports_autograd))):
            if i >= tries:
                break
            first = s.input[0] if isinstance(s.input, (list, tuple)) and s.input else s.input
            if isinstance(first, torch.Tensor) and first.dim() >= min_dim and first.shape[0] in (1, 2):
                if min_dim > 1 and any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in _leaves(s)[0]):
                    continue
                found.append((first.dim() < 2, i, first.shape[0], s))
    except Exception:
        return None
    for _, _, n, s in sorted(found, key=lambda f: f[:2]):
        leaves, spec = _leaves(s)
        tiled = [t.detach().repeat_interleave(4 // n, dim=0) if isinstance(t, torch.Tensor) and t.dim() > 0
                 and t.shape[0] == n else t for t in leaves]
        if any(isinstance(t, torch.Tensor) and t.numel() > max_numel for t in tiled):
            continue
        try:
            inp, args, kwargs = compat.tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t
                                                       for t in tiled], spec)
            op.op(inp, *args, **kwargs)
        except Exception:
            continue
        inp, args, kwargs = compat.tree_unflatten(tiled, spec)
        out = type(s)(inp, args=args, kwargs=kwargs)
        if independent and not independent_samples(op, out):
            continue
        return out
    return None


class _Holder(nn.Module):
    def put(self, name: str, value: torch.Tensor, param: bool) -> None:
        if param:
            self.register_parameter(name, value)
        else:
            self.register_buffer(name, value)


class _OpStep(nn.Module):
    """``forward(*batch)`` -> ``(sum_k <out_k, t_k>,)``: leaf ``i`` of the sample is ``batch[j]`` or
    ``state.a<i>``, tangent ``k`` is ``batch[j]`` or ``state.t<k>`` (``where``: leaf/tangent -> ("batch", j)
    or ("state", name))."""

    def __init__(self, fn: Callable, spec: Any, leaf_where: list, tangent_where: list, out_index: list[int]):
        super().__init__()
        object.__setattr__(self, "fn", fn)
        self.state = _Holder()
        self.spec, self.leaf_where, self.tangent_where, self.out_index = spec, leaf_where, tangent_where, out_index

    def _get(self, where: Any, batch: tuple) -> Any:
        kind, key = where
        if kind == "batch":
            return batch[key]
        if kind == "state":
            return getattr(self.state, key)
        return key  # a non-tensor leaf

    def forward(self, *batch: torch.Tensor):
        leaves = [self._get(w, batch) for w in self.leaf_where]
        outs = compat.tree_leaves(self.fn(*compat.tree_unflatten(leaves, self.spec)))
        loss = sum((outs[i] * self._get(w, batch)).sum() for i, w in zip(self.out_index, self.tangent_where))
        return (loss,)


def _call(op: Any) -> Callable:
    def fn(inp, args, kwargs):
        return op.op(inp, *args, **kwargs)
    return fn


@dataclasses.dataclass
class Case:
    """One op sample, laid out for one setting: the step, its batch and state (real tensors), and eager's
    loss and gradients (``grads``: batch index or state name -> gradient)."""

    step: _OpStep
    batch: tuple
    state: dict[str, torch.Tensor]
    sharded: dict[str, Any]  # state name -> adaptdist Placement (setting "other")
    loss: torch.Tensor
    grads: dict[Any, torch.Tensor]


def _float_outputs(result: Any) -> list[int]:
    return [i for i, o in enumerate(compat.tree_leaves(result))
            if isinstance(o, torch.Tensor) and o.is_floating_point()]


def build_case(op: Any, sample: Any, setting: str, seed: int = 0) -> Case | Outcome:
    """The step of ``sample`` for ``setting`` with eager's reference, or the expected-failure Outcome."""
    from adaptdist.placement import Shard

    leaves, spec = _leaves(sample)
    grad = bool(op.supports_autograd)
    first = sample.input[0] if isinstance(sample.input, (list, tuple)) else sample.input
    bsz = first.shape[0]
    real = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
    fn = _call(op)

    def run(ls):  # on copies: an in-place op (cauchy_, ...) must not change the sample
        ls = [t.clone() if isinstance(t, torch.Tensor) else t for t in ls]
        return fn(*compat.tree_unflatten(ls, spec))

    try:
        torch.manual_seed(seed)
        r1 = run(real)
        torch.manual_seed(seed + 1)
        r2 = run(real)
    except Exception as e:
        return Outcome("xfail", f"sample fails eagerly: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    outs = compat.tree_leaves(r1)
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in list(leaves) + list(outs)):
        return Outcome("xfail", "sparse tensors (adaptdist captures strided tensors)")
    out_index = _float_outputs(r1)
    if not out_index:
        return Outcome("xfail", "no floating-point output (integer or boolean result)")
    for i in out_index:
        a, b = outs[i], compat.tree_leaves(r2)[i]
        if a.shape != b.shape or not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
            return Outcome("xfail", "random op (two seeds give different outputs)")
    if any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()
           for t in [outs[i] for i in out_index]):
        return Outcome("xfail", "non-finite output on the sample")
    gen = torch.Generator().manual_seed(seed)
    tangents = [torch.randn(outs[i].shape, generator=gen) for i in out_index]

    batch: list[torch.Tensor] = []
    state: dict[str, torch.Tensor] = {}
    sharded: dict[str, Any] = {}
    leaf_where, tangent_where = [], []
    for i, t in enumerate(real):
        if not isinstance(t, torch.Tensor):
            leaf_where.append(("const", t))
            continue
        if setting == "batch" and t.dim() > 0 and t.shape[0] == bsz:
            leaf_where.append(("batch", len(batch)))
            batch.append(t)
        else:
            name = f"a{i}"
            leaf_where.append(("state", name))
            state[name] = t
            if setting == "other" and i == 0 and t.dim() >= 2:
                dims = [d for d in range(1, t.dim()) if t.shape[d] >= 3]
                if dims:
                    sharded[name] = Shard(dims[-1])
    if setting == "other" and not sharded:
        return Outcome("xfail", "n/a: the first input has no dim but dim 0 of size >= 3")
    for k, t in enumerate(tangents):
        if setting == "batch" and t.dim() > 0 and t.shape[0] == bsz:
            tangent_where.append(("batch", len(batch)))
            batch.append(t)
        else:
            tangent_where.append(("state", f"t{k}"))
            state[f"t{k}"] = t
    if not batch:
        # the capture contract wants a batch: a dummy row per sample (unused by the op)
        batch.append(torch.zeros(bsz, dtype=torch.long))

    # eager reference: loss and the gradient of every differentiable input
    ref_batch = [b.clone().requires_grad_(b.is_floating_point() and (grad or _is_tangent(tangent_where, j)))
                 for j, b in enumerate(batch)]
    ref_state = {n: v.clone().requires_grad_(v.is_floating_point() and (grad or n.startswith("t")))
                 for n, v in state.items()}
    step = _OpStep(fn, spec, leaf_where, tangent_where, out_index)
    for n, v in ref_state.items():
        step.state.put(n, nn.Parameter(v, requires_grad=v.requires_grad) if v.requires_grad else v, v.requires_grad)
    try:
        (loss,) = step(*ref_batch)
        loss.backward()
    except Exception as e:
        return Outcome("xfail", f"no backward on the sample: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    grads: dict[Any, torch.Tensor] = {}
    for j, b in enumerate(ref_batch):
        if b.requires_grad:
            grads[j] = b.grad if b.grad is not None else torch.zeros_like(b)
    for n, p in step.state.named_parameters():
        grads[n] = p.grad if p.grad is not None else torch.zeros_like(p)
    return Case(step, tuple(b.detach() for b in ref_batch), {n: v.detach() for n, v in ref_state.items()},
                sharded, loss.detach(), grads)


ADDRESSES_ANY_ROW = {
    "_unsafe_masked_index": "its index tensors address any row of the input",
    "_unsafe_masked_index_put_accumulate": "its index tensors address any row of the output",
    "as_strided_scatter": "its size/stride/offset address any element of the output",
}
"""Ops whose arguments may address any row of the batch: the chunk check below can pass on one sample's
values, but no split is right for every index value, so they are not counted as sample-independent."""


def independent_samples(op: Any, sample: Any, chunks: int = 2) -> bool:
    """Whether the op keeps samples independent on this sample: the op on each chunk of the batch-sized
    tensors (dim 0 of the first input's size, split in ``chunks``; the others whole), concatenated on dim 0,
    equals the op on the whole batch (every float output batch-sized). What DDP's batch split needs.
    False for :data:`ADDRESSES_ANY_ROW` whatever the sample."""
    if op_key(op) in ADDRESSES_ANY_ROW:
        return False
    leaves, spec = _leaves(sample)
    first = sample.input[0] if isinstance(sample.input, (list, tuple)) else sample.input
    bsz = first.shape[0]
    from adaptdist.placement import chunk_interval

    fn = _call(op)
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves):
        return False
    pieces = []
    for c in range(chunks):
        s, e = chunk_interval(bsz, chunks, c)
        pieces.append([t.detach()[s:e] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == bsz
                       else t.detach() if isinstance(t, torch.Tensor) else t for t in leaves])
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # it logs every meta kernel that rejects a chunk's shapes
    try:
        # on fake tensors first: a CPU kernel given a chunk of a per-channel tensor (BatchNorm's running
        # statistics) may not check its shapes and write past the end; the meta kernels check them
        mode = compat.fake_tensor_mode()
        with torch.no_grad(), mode:
            for ls in pieces:
                fn(*compat.tree_unflatten([mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in ls],
                                          spec))
        with torch.no_grad():
            whole = compat.tree_leaves(fn(*compat.tree_unflatten(
                [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], spec)))
            parts = [compat.tree_leaves(fn(*compat.tree_unflatten(ls, spec))) for ls in pieces]
    except Exception:
        return False
    finally:
        fake_log.setLevel(level)
    for i, w in enumerate(whole):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        if w.dim() == 0 or w.shape[0] != bsz:
            return False
        try:
            got = torch.cat([p[i] for p in parts])
        except Exception:
            return False
        try:
            if got.shape != w.shape or not torch.allclose(got, w.to(got.dtype), rtol=RTOL, atol=ATOL, equal_nan=True):
                return False
        except Exception:  # outputs that do not compare (dtypes that differ per chunk, ...)
            return False
    return True


def _is_tangent(tangent_where: list, j: int) -> bool:
    return ("batch", j) in tangent_where


def capture_case(case: Case) -> Any:
    """The joint graph of ``case.step`` as a CapturedGraph (roles ``loss``, ``grad:<state>``, ``grad_in:<j>``).

    Raises:
        CaptureError: the exporter cannot follow the op (data-dependent shape, ...).
    """
    from adaptdist.compiler.capture import CapturedGraph, order_placeholders, set_input_roles

    mode = compat.fake_tensor_mode(allow_constants=True)
    step = case.step
    with mode:
        holder = _Holder()
        for n, v in step.state.named_parameters():
            holder.put(n, nn.Parameter(mode.from_tensor(v.detach()), requires_grad=True), True)
        for n, v in step.state.named_buffers():
            holder.put(n, mode.from_tensor(v), False)
        object.__setattr__(step, "_real_state", step.state)
        step.state = holder
    grads_wanted = {j for j in case.grads if isinstance(j, int)}
    with mode:
        fake_batch = tuple(mode.from_tensor(b).requires_grad_(j in grads_wanted) for j, b in enumerate(case.batch))
    try:
        try:
            gm, sig = compat.aot_export_joint(step, fake_batch, loss_index=0)
        except Exception as e:
            raise CaptureError(f"cannot capture {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                               ) from e
    finally:
        step.state = step._real_state
    graph = gm.graph
    strip = len("state.")
    set_input_roles(graph, sig, strip)
    out_node = graph.output_node()
    by_name = {n.name: n for n in out_node.args[0] if isinstance(n, torch.fx.Node)}
    bw = sig.backward_signature
    loss = by_name[sig.user_outputs[0]]
    grad_of = {p[strip:]: by_name[g] for g, p in bw.gradients_to_parameters.items()}
    user_ph = list(sig.user_inputs)
    grad_in = {user_ph.index(u): by_name[g] for g, u in bw.gradients_to_user_inputs.items()}
    params = [gmeta.get_fqn(p) for p in graph.find_nodes(op="placeholder") if gmeta.get_role(p) == "param"]
    trainable = [f for f in params if f in grad_of]
    frozen = [f for f in params if f not in grad_of]
    out_node.args = (tuple([loss] + [grad_of[f] for f in trainable] + [grad_in[k] for k in sorted(grad_in)]),)
    gmeta.set_output_roles(out_node, ["loss"] + [f"grad:{f}" for f in trainable]
                           + [f"grad_in:{k}" for k in sorted(grad_in)])
    ranked = order_placeholders(graph, set(frozen))
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return CapturedGraph(
        gm=gm, param_fqns=trainable, frozen_param_fqns=frozen,
        buffer_fqns=[gmeta.get_fqn(p) for p in ranked if gmeta.get_role(p) == "buffer"],
        num_batch_inputs=len(user_ph), mutated_buffer_fqns=[], loss_output_index=0,
        grad_output_index={f: 1 + i for i, f in enumerate(trainable)}, batch_size=case.batch[0].shape[0],
        model_name="op",
    )


def lower_case(cg: Any, case: Case, world_size: int, setting: str) -> dict:
    from adaptdist.compiler.lowering import lower
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.plan import Plan, graph_fingerprint

    plan = Plan(mesh={"dp": world_size}, batch_axis="dp" if setting == "batch" else None,
                param_placements={f: (p,) for f, p in case.sharded.items()},
                graph_fingerprint=graph_fingerprint(cg.gm), name="opinfo")
    state = {f: case.state[f] for f in cg.input_fqns}
    return lower(cg, plan, LoweringOptions(), state=state)


def _close(got: Any, want: torch.Tensor) -> str:
    if not isinstance(got, torch.Tensor):
        return f"not a tensor ({type(got).__name__})"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL, atol=ATOL, equal_nan=True)
    except AssertionError as e:
        return " ".join(str(e).split("\n")[1:3]).strip()
    return ""


def check_programs(progs: dict, case: Case, world_size: int) -> str:
    """Run every rank's program in one process; '' if each rank's loss and gradients (its rows of a batch
    input's, its shard of a parameter's) equal eager's, else what differs."""
    from adaptdist.placement import parse_placement
    from adaptdist.runtime.simulate import simulate_ranks

    from passutil import local_shard

    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(case.batch)) for p in progs.values()]
    outs = simulate_ranks([p.module for p in progs.values()], ins)
    for r, p in progs.items():
        by_role = dict(zip(p.output_roles, outs[r]))
        bad = _close(by_role["loss"], case.loss)
        if bad:
            return f"rank {r} loss: {bad}"
        for key, want in case.grads.items():
            if isinstance(key, int):
                role = f"grad_in:{key}"
                off, size = p.batch_slice
                want = want[off:off + size]
            else:
                role = f"grad:{key}"
                pl = p.state_placements.get(key)
                if pl:
                    want = local_shard(want, parse_placement(pl[0]), world_size, r)
            if role not in by_role:
                if want.abs().max() == 0 if want.numel() else True:
                    continue  # no gradient flows (export dropped a zero gradient)
                return f"rank {r}: no output {role}"
            bad = _close(by_role[role], want)
            if bad:
                return f"rank {r} {role}: {bad}"
    return ""


def _collectives(progs: dict) -> tuple[str, ...]:
    """The collective kinds the programs issue; an all_gather that feeds nothing but the gradients of
    replicated tangents (``grad:t<k>``, the op's own output gathered because this harness made the tangent
    of an output whose dim 0 is not the batch a replicated parameter; a model consumes that output as it
    lies) is ``all_gather(tangent grad)``, which does not count as gathering the batch."""
    kinds = set()
    for p in progs.values():
        graph = p.graph_module.graph
        out = graph.output_node()
        roles = list(p.output_roles)
        tangent_only = {a for a, r in zip(out.args[0], roles) if isinstance(r, str) and r.startswith("grad:t")}
        other = {a for a, r in zip(out.args[0], roles) if not (isinstance(r, str) and r.startswith("grad:t"))}
        for n in graph.nodes:
            if n.op == "call_function":
                k = compat.functional_collective_kind(n.target)
                if k not in (None, "wait"):
                    if k == "all_gather" and _feeds_only(n, tangent_only, other, out):
                        k = "all_gather(tangent grad)"
                    kinds.add(k)
    return tuple(sorted(kinds))


def _feeds_only(node: Any, tangent_only: set, other: set, out: Any) -> bool:
    """Whether every path from ``node`` to the graph's output ends at an output in ``tangent_only``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u is out:
                if n in other or n not in tangent_only:
                    return False
            else:
                todo.append(u)
    return True


def run_op(op: Any, world_sizes: tuple[int, ...] = (2, 3), settings: tuple[str, ...] = SETTINGS,
           sample: Any = None) -> dict[str, dict[int, Outcome]]:
    """Outcome of ``op``'s sample per setting and world size."""
    sample = sample if sample is not None else pick_sample(op)
    res: dict[str, dict[int, Outcome]] = {}
    for setting in settings:
        res[setting] = {}
        if sample is None:
            for w in world_sizes:
                res[setting][w] = Outcome("xfail", "no float32 CPU sample with a tensor input of dim 0 >= 3")
            continue
        try:
            case = build_case(op, sample, setting)
        except Exception as e:  # the sample is of a kind this harness does not lay out
            case = Outcome("xfail", f"sample not usable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        if isinstance(case, Outcome):
            for w in world_sizes:
                res[setting][w] = case
            continue
        try:
            cg = capture_case(case)
        except CaptureError as e:
            for w in world_sizes:
                res[setting][w] = Outcome("xfail", f"not capturable: {str(e)[:200]}")
            continue
        except Exception as e:
            for w in world_sizes:
                res[setting][w] = Outcome("bug", f"capture crashed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rng = sorted({str(n.target) for n in cg.gm.graph.nodes if n.op == "call_function"
                      and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())})
        for w in world_sizes:
            res[setting][w] = (Outcome("xfail", f"random op ({', '.join(rng)}): each rank draws its own numbers, "
                                                "not one process's (see the rng option of issue 14)")
                               if rng else _run_lowered(cg, case, w, setting))
    return res


def _run_lowered(cg: Any, case: Case, w: int, setting: str) -> Outcome:
    from adaptdist.errors import InternalError

    try:
        progs = lower_case(cg, case, w, setting)
    except UnsupportedOpError as e:
        return Outcome("refused", str(e).splitlines()[0][:300])
    except InternalError as e:
        return Outcome("bug", f"InternalError: {str(e).splitlines()[0][:300]}")
    except AdaptdistError as e:
        return Outcome("refused", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Outcome("bug", f"lowering crashed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                              f" ({tb.filename.rsplit('/', 1)[-1]}:{tb.lineno})")
    colls = _collectives(progs)
    try:
        bad = check_programs(progs, case, w)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Outcome("bug", f"programs crashed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                              f" ({tb.filename.rsplit('/', 1)[-1]}:{tb.lineno})", colls)
    if bad:
        return Outcome("bug", f"wrong value: {bad}", colls)
    if setting == "batch" and "all_gather" in colls:
        return Outcome("gathers", "equal to eager, but a rank gathers the batch", colls)
    return Outcome("supported", "", colls)


# ---------------------------------------------------------------- DTensor's coverage of the same samples

def dtensor_outcome(op: Any, sample: Any = None) -> Outcome:
    """DTensor on a fake process group of 2 ranks (this process rank 0; call inside
    :func:`dtensor_world`): the sample's batch-sized tensors ``distribute_tensor``'d Shard(0), the others
    Replicate. ``supported``: the op runs and every float output keeps a Shard placement with no all_gather
    (CommDebugMode); ``gathers``: it runs but gathers or ends replicated; ``refused``: it raises.
    Forward only (fake collectives move no data: values are not compared)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    sample = sample if sample is not None else pick_sample(op)
    if sample is None:
        return Outcome("xfail", "no float32 CPU sample with a tensor input of dim 0 >= 3")
    leaves, spec = _leaves(sample)
    first = sample.input[0] if isinstance(sample.input, (list, tuple)) else sample.input
    bsz = first.shape[0]
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves):
        return Outcome("xfail", "sparse tensors")
    mesh = dtensor_world.mesh
    try:
        dl = [distribute_tensor(t.detach(), mesh, [Shard(0) if t.dim() > 0 and t.shape[0] == bsz else Replicate()])
              if isinstance(t, torch.Tensor) else t for t in leaves]
    except Exception as e:
        return Outcome("xfail", f"cannot distribute the sample: {type(e).__name__}")
    try:
        with CommDebugMode() as comm:
            out = _call(op)(*compat.tree_unflatten(dl, spec))
    except Exception as e:
        return Outcome("refused", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    outs = [o for o in compat.tree_leaves(out) if isinstance(o, DTensor)]
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    gathered = any("all_gather" in k or "all_to_all" in k for k in counts)
    kept = outs and all(any(isinstance(p, Shard) for p in o.placements) for o in outs if o.dim() > 0 and
                        o.shape[0] == bsz)
    if gathered or not kept:
        return Outcome("gathers", "", tuple(sorted(counts)))
    return Outcome("supported", "", tuple(sorted(counts)))


class dtensor_world:
    """Context manager: a fake process group of 2 ranks and a 1-D DeviceMesh on it (``dtensor_world.mesh``)."""

    mesh: Any = None

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        compat.fake_process_group(0, 2)
        type(self).mesh = init_device_mesh("cpu", (2,))
        self._dist = dist
        return self

    def __exit__(self, *exc):
        type(self).mesh = None
        self._dist.destroy_process_group()
        return False


def summarize(results: dict[str, dict]) -> dict[str, dict[str, int]]:
    """{setting/world: {category: count}} over ``{op: {setting: {world: Outcome}}}``; an op's category per
    setting is its worst over the world sizes (bug > refused > gathers > xfail > supported)."""
    rank = {"bug": 4, "refused": 3, "gathers": 2, "xfail": 1, "supported": 0}
    counts: dict[str, dict[str, int]] = {}
    for per in results.values():
        for setting, by_w in per.items():
            if setting == "dtensor":
                key, cat = "dtensor", by_w.category
                counts.setdefault(key, {c: 0 for c in CATEGORIES})[cat] += 1
                continue
            worst = max((o.category for o in by_w.values()), key=rank.__getitem__)
            counts.setdefault(setting, {c: 0 for c in CATEGORIES})[worst] += 1
    return counts


def timed(fn: Callable, *a: Any, **k: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t
