"""Capture for the torch.compile backend: one rank's Dynamo graph -> the joint graph of all ranks' step.

Under the backend's input contract (DDP's), each of the ``W`` ranks calls the compiled forward on
its own inputs. The global computation is every rank's forward at once, which ``torch.vmap`` over
a new leading *rank* dim expresses exactly: constants Dynamo baked into the graph for this rank's
shapes (view sizes, the batch size) stay per-rank constants, and whatever the model reduces over
its inputs (a mean loss, BatchNorm statistics) stays per rank, as under DDP. Every user input and
every output gets that leading dim of size ``W``; row ``r`` is rank ``r``'s. Buffers a training-mode
BatchNorm updates get one copy per rank under the vmap, and the step returns rank 0's (DDP's buffer
broadcast); ``batch_norm="sync"`` computes the statistics over every rank's rows (:func:`global_batch_norm`).

Attention is captured in its math form (matmul, softmax): torch's fused CPU attention kernel has no
vmap rule, and vmap would run it once per rank (``select`` of each rank's row: a gather under any
plan). The math form materializes the ``T x T`` scores per head; the fused kernel would not.

The backward needs the outputs' gradients, which arrive only at ``loss.backward()``: they enter the
joint graph as inputs too (``tangents``, also ``[W, ...]``), and the step's scalar "loss" is
``sum_k <out_k, tangent_k>``, whose gradient is each parameter's vector-Jacobian product summed
over ranks (source: reverse-mode AD as a VJP, e.g. Baydin et al., "Automatic Differentiation in
Machine Learning: a Survey", 2018, section 3.2). The runtime divides the parameters' gradients by
``W`` (DDP averages them) and splits the joint program into its forward and backward parts.

Graph contract (adds two output roles to :mod:`adaptdist.compiler.capture`'s):
    placeholders = [params..., buffers..., stacked user inputs..., stacked tangents...]
    outputs      = (loss, grads of params..., ``out:k`` stacked forward outputs...,
                    ``grad_in:k`` gradients of the stacked user inputs that require grad...,
                    ``buffer:<fqn>`` new values of the buffers the forward updates, whole...)
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import CaptureError
from .capture import CapturedGraph, _gc_paused, order_placeholders, set_input_roles
from .autocast_grad_sums import sum_cast_gradients_in_low_precision
from .batch_arange_index import fold_batch_arange_index
from .strided_views import fold_contiguous_as_strided
from .unit_scalings import fold_unit_scalings

_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the Dynamo graph: ``kind`` is ``param``, ``buffer`` or ``input`` (a user
    input, per rank); ``fqn`` the module path of a parameter/buffer (``blocks.0.attn.qkv.weight``) or the
    source text of an input (``L['x']``); ``global_shape`` its shape (one rank's, for an input; the full
    shape of a parameter an earlier compiled graph sharded, whose ``layout`` is then set); ``source``
    Dynamo's source text."""

    kind: str
    fqn: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    source: str = ""
    layout: Any = None  # the ShardLayout of a parameter an earlier compiled graph already sharded
    device: torch.device = torch.device("cpu")  # where the example value is: the capture's fake tensors go there too


def source_fqn(source_name: str) -> str | None:
    """``L['self']._modules['blocks']._modules['0']._parameters['weight']`` -> ``blocks.0.weight``;
    None for a source that is not a module attribute chain."""
    parts = _SOURCE_PART.findall(source_name)
    return ".".join(parts) if parts else None


def classify_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[GraphInput]:
    """What each placeholder of a Dynamo graph is (from its source and its example value).

    Raises:
        CaptureError: a non-tensor input (a symbolic size: this backend compiles static shapes), or a
            parameter Dynamo did not lift into an input (``inline_inbuilt_nn_modules`` turned off).
    """
    if any(n.op == "get_attr" and isinstance(getattr(gm, n.target, None), nn.Parameter) for n in gm.graph.nodes):
        raise CaptureError("the Dynamo graph holds parameters as attributes; the adaptdist backend needs them as "
                           "graph inputs (torch._dynamo.config.inline_inbuilt_nn_modules=True, torch's default)")
    out = []
    for ph, ex in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        source = compat.dynamo_source_name(ph)
        if not isinstance(ex, torch.Tensor):
            raise CaptureError(
                f"graph input {source or ph.name} is a {type(ex).__name__}, not a tensor: Dynamo made a shape "
                "symbolic (dynamic=True does, and so does the default after meeting the same code with other input "
                "shapes), and the adaptdist backend compiles static shapes: call torch.compile(..., dynamic=False), "
                "which compiles each shape on its own")
        fqn = source_fqn(source or "")
        if isinstance(ex, nn.Parameter):
            layout = getattr(ex, "_adaptdist_layout", None)
            shape = tuple(layout.global_shape) if layout is not None else tuple(ex.shape)
            out.append(GraphInput("param", fqn or ph.name, shape, ex.dtype, ex.requires_grad, source or "", layout,
                                  ex.device))
        elif fqn is not None and "._buffers[" in (source or ""):
            out.append(GraphInput("buffer", fqn, tuple(ex.shape), ex.dtype, False, source or "", device=ex.device))
        else:
            out.append(GraphInput("input", source or ph.name, tuple(ex.shape), ex.dtype,
                                  ex.requires_grad and ex.is_floating_point(), source or "", device=ex.device))
    return out


def _batch_norm_calls(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, bool]]:
    """The training-mode ``F.batch_norm`` calls of a Dynamo graph, each with whether it has running statistics."""
    import torch.nn.functional as F

    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not F.batch_norm:
            continue
        names = ("input", "running_mean", "running_var", "weight", "bias", "training")
        args = dict(zip(names, n.args))
        args.update({k: v for k, v in n.kwargs.items() if k in names})
        if args.get("training", False):
            found.append((n, args.get("running_mean") is not None))
    return found


def check_batch_norm(gm: torch.fx.GraphModule, mode: str) -> None:
    """Refuse training-mode BatchNorm the backend cannot train as asked: one whose momentum is not a Python
    number (``momentum=None``, the cumulative average, reads ``num_batches_tracked`` in the forward). Under
    ``"local"`` each rank's statistics come from its rows (DDP's), under ``"sync"`` from every rank's
    (:func:`global_batch_norm`); the running statistics end as rank 0's on every rank (:func:`capture_all_ranks`).

    Raises:
        CaptureError: names the BatchNorm's source line and what to use instead.
    """
    for n, running in _batch_norm_calls(gm):
        where = (n.meta.get("stack_trace") or "").strip().splitlines()
        at = f" ({where[-2].strip()})" if len(where) >= 2 else ""
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        args = dict(zip(names, n.args))
        args.update({k: v for k, v in n.kwargs.items() if k in names})
        momentum = args.get("momentum", 0.1)
        if running and not isinstance(momentum, (int, float)):
            raise CaptureError(
                f"adaptdist.backend(batch_norm={mode!r}): BatchNorm in training mode{at} has momentum "
                f"{momentum!r}, not a number (momentum=None, the cumulative average, is not supported under the "
                "backend): give BatchNorm a momentum (0.1 is the default), or train it with adaptdist train")


def running_stat_buffers(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> list[str]:
    """Fqns of the buffers that training-mode ``F.batch_norm`` calls of the Dynamo graph update from the batch
    (``running_mean``, ``running_var``), in placeholder order: each rank updates its own copy from its rows."""
    index = {ph: k for k, ph in enumerate(gm.graph.find_nodes(op="placeholder"))}
    used = set()
    for n, running in _batch_norm_calls(gm):
        if not running:
            continue
        names = ("input", "running_mean", "running_var")
        args = dict(zip(names, n.args))
        args.update({k: v for k, v in n.kwargs.items() if k in names})
        for key in ("running_mean", "running_var"):
            a = args.get(key)
            if not isinstance(a, torch.fx.Node) or a not in index or inputs[index[a]].kind != "buffer":
                raise CaptureError(f"BatchNorm in training mode ({n.name}): its {key} is not a buffer of the module; "
                                   "the adaptdist backend updates running statistics held as module buffers")
            used.add(index[a])
    return [inputs[k].fqn for k in sorted(used)]


class _RowStats(torch.autograd.Function):
    """``(mean, biased var)`` of ``rows`` over ``dims`` (``n`` elements each), with the backward written as sums
    broadcast against ``rows`` (``grad_rows = (g_mean + 2 (rows - mean) g_var) / n``), so that a statistic's
    gradient summed over the ranks (a partial sum) is all-reduced at its size ``[C]``; autograd's own backward
    would expand it to the rows' shape first, and the planner would reduce that whole tensor."""

    @staticmethod
    def forward(rows: torch.Tensor, dims: list[int], view: list[int], n: int):
        mean = rows.sum(dims) / n
        centered = rows - mean.view(view)
        return mean, (centered * centered).sum(dims) / n

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        rows, _, ctx.view, ctx.n = inputs
        ctx.save_for_backward(rows, output[0])

    @staticmethod
    def vmap(info: Any, in_dims: tuple, rows: torch.Tensor, dims: list[int], view: list[int], n: int):
        # called on the rows of every rank, which vmap does not batch (in_dims[0] is None)
        assert in_dims[0] is None, in_dims
        return _RowStats.apply(rows, dims, view, n), (None, None)

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor | None, g_var: torch.Tensor | None):
        rows, mean = ctx.saved_tensors
        view, n = ctx.view, ctx.n
        grad = None
        if g_var is not None:
            grad = (2.0 / n) * (rows - mean.view(view)) * g_var.view(view)
        if g_mean is not None:
            grad = g_mean.view(view) / n if grad is None else grad + g_mean.view(view) / n
        grad = torch.zeros_like(rows) if grad is None else grad.expand_as(rows)
        return grad, None, None, None


def _batch_norm_rows(input: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                     weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool, momentum: float,
                     eps: float, over_ranks: bool) -> torch.Tensor:
    """Training-mode ``F.batch_norm`` of one rank's rows ``input [N, C, *S]`` under the vmap over ranks, written
    on every rank's rows at once (``[W, N, C, *S]``) as plain sums: per rank (``over_ranks=False``, DDP's) or
    over every rank's rows (SyncBatchNorm's), which the planner turns into all_reduces of ``[C]``. Each rank's
    copy of the running statistics is updated with its statistics (the variance unbiased, ``n / (n - 1)``).
    torch.vmap's own rule for BatchNorm would fold the ranks into the channels, which the planner can only
    gather. Outside vmap, or not in training mode, it is ``F.batch_norm``."""
    import torch.nn.functional as F

    rows, level = compat.vmap_unwrap(input)
    if not training or level is None or rows.dim() < 3:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    world, channels = rows.shape[0], rows.shape[2]
    dims = ([0, 1] if over_ranks else [1]) + list(range(3, rows.dim()))
    n = rows.numel() // max(1, channels) // (1 if over_ranks else world)
    view = [1 if over_ranks else world, 1, channels] + [1] * (rows.dim() - 3)
    mean, var = _RowStats.apply(rows, dims, view, n)  # [C] (over_ranks) or [W, C]; var biased
    centered = rows - mean.view(view)
    out = centered * torch.rsqrt(var + eps).view(view)
    affine = [1, 1, channels] + [1] * (rows.dim() - 3)
    if weight is not None:
        out = out * weight.view(affine)
    if bias is not None:
        out = out + bias.view(affine)
    with torch.no_grad():
        for buf, stat in ((running_mean, mean), (running_var, var * (n / max(1, n - 1)))):
            if buf is not None:
                stat = stat.expand(world, channels) if over_ranks else stat
                buf.copy_(buf * (1.0 - momentum) + compat.vmap_wrap(stat, level) * momentum)
    return compat.vmap_wrap(out, level)


def local_batch_norm(input: torch.Tensor, running_mean: torch.Tensor | None = None,
                     running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, training: bool = False, momentum: float = 0.1,
                     eps: float = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` under the vmap over ranks with each rank's statistics (DDP's; :func:`_batch_norm_rows`)."""
    return _batch_norm_rows(input, running_mean, running_var, weight, bias, training, momentum, eps, False)


def global_batch_norm(input: torch.Tensor, running_mean: torch.Tensor | None = None,
                      running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, training: bool = False, momentum: float = 0.1,
                      eps: float = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` under the vmap over ranks with the statistics of every rank's rows (SyncBatchNorm's;
    :func:`_batch_norm_rows`)."""
    return _batch_norm_rows(input, running_mean, running_var, weight, bias, training, momentum, eps, True)


def _with_batch_norm_rows(gm: torch.fx.GraphModule, mode: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose training-mode ``F.batch_norm`` calls are :func:`local_batch_norm` or
    :func:`global_batch_norm` (``mode`` ``"sync"``); ``gm`` itself when it has none."""
    calls = _batch_norm_calls(gm)
    if not calls:
        return gm
    graph = copy.deepcopy(gm.graph)
    by_name = {n.name: n for n in graph.nodes}
    for n, _ in calls:
        by_name[n.name].target = global_batch_norm if mode == "sync" else local_batch_norm
    return torch.fx.GraphModule(gm, graph)


def _graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """Example values of the Dynamo graph's outputs (fake tensors)."""
    outs = gm.graph.output_node().args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.meta.get("example_value", o.meta.get("val")) if isinstance(o, torch.fx.Node) else o for o in outs]


def _outputs_reached_from_grad_inputs(gm: torch.fx.GraphModule, inputs: list["GraphInput"]) -> set[int]:
    """Indices of the Dynamo graph's outputs that data flows into from an input requiring grad (a parameter,
    an activation from an earlier graph), following every node's inputs; decided from the graph, not from
    the example values' ``requires_grad`` (False for all under ``no_grad()``)."""
    reached = {ph for ph, i in zip(gm.graph.find_nodes(op="placeholder"), inputs) if i.requires_grad}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and any(
                a in reached for a in node.all_input_nodes):
            reached.add(node)
    outs = gm.graph.output_node().args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return {k for k, o in enumerate(outs) if o in reached}


class _Holder(nn.Module):
    """A module tree holding tensors under their original dotted names (so plans and state dicts
    speak the user's parameter names)."""

    def put(self, fqn: str, value: torch.Tensor, param: bool) -> None:
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        if param:
            mod.register_parameter(leaf, value)
        else:
            mod.register_buffer(leaf, value)


class _AllRanksStep(nn.Module):
    """``forward(*stacked_inputs, *tangents)`` -> ``(sum_k <out_k, tangent_k>, *outs)``: every rank's
    forward at once (vmap over dim 0), outputs detached (returned for the forward program)."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[GraphInput], tangent_outputs: list[int],
                 world_size: int, per_rank_buffers: Sequence[str] = ()):
        super().__init__()
        object.__setattr__(self, "gm", gm)  # not a submodule: its state is the holder's
        self.state = _Holder()
        self.inputs = inputs
        self.tangent_outputs = tangent_outputs
        self.world_size = world_size
        self.per_rank_buffers = list(per_rank_buffers)

    def forward(self, *batch: torch.Tensor):
        n_user = sum(1 for i in self.inputs if i.kind == "input")
        user, tangents = batch[:n_user], batch[n_user:]
        state = dict(self.state.named_parameters())
        state.update(dict(self.state.named_buffers()))
        # buffers the forward updates from its rows (BatchNorm's running statistics): one copy per rank, which
        # the rank's forward updates in place under vmap; the step returns rank 0's (DDP broadcasts rank 0's)
        rows = [state[f].unsqueeze(0).expand(self.world_size, *state[f].shape).clone() for f in self.per_rank_buffers]
        own = {f: k for k, f in enumerate(self.per_rank_buffers)}

        def one_rank(*xs):
            xs, bufs = xs[:n_user], xs[n_user:]
            it = iter(xs)
            args = [bufs[own[i.fqn]] if i.fqn in own else next(it) if i.kind == "input" else state[i.fqn]
                    for i in self.inputs]
            res = self.gm(*args)
            return tuple(res) if isinstance(res, (tuple, list)) else (res,)

        outs = torch.vmap(one_rank, randomness="different")(*user, *rows)
        loss = sum((outs[k] * t).sum() for k, t in zip(self.tangent_outputs, tangents))
        return (loss, *(o.detach() for o in outs), *(r[0] for r in rows))


def capture_all_ranks(gm: torch.fx.GraphModule, inputs: list[GraphInput], world_size: int,
                      batch_norm: str = "local", rng: str = "per-rank") -> tuple[CapturedGraph, list[int]]:
    """The joint graph of all ``world_size`` ranks' forward and backward (module docstring).

    Args:
        gm: Dynamo's graph of one rank's forward (its placeholders described by ``inputs``).
        inputs: from :func:`classify_inputs`.
        world_size: ``W``, the size of the stacked rank dim.
        batch_norm: training-mode BatchNorm's statistics: ``"local"`` (each rank's rows, as DDP) or ``"sync"``
            (every rank's rows, :func:`global_batch_norm`); the running statistics end as rank 0's.
        rng: ``"global"``: each random op is annotated with where one rank's batch rows are in its shape
            (:func:`adaptdist.compiler.eager_batch.annotate_eager_batch`), so the global-rng pass draws it in
            the order one process on the whole batch does.

    Returns:
        A CapturedGraph whose batch inputs are the stacked user inputs then the stacked tangents, with
        ``batch_size == W`` and the output roles of the module docstring; and the indices of the outputs
        that take a tangent (those requiring grad), in tangent order.

    Raises:
        CaptureError: the graph cannot be run for all ranks at once (an op without a vmap rule, a buffer
            updated in place, a data-dependent shape), naming the construct and what to try.
    """
    from .checkpoint_regions import recompute_regions, with_marked_regions

    gm = with_marked_regions(gm)  # a user's torch.utils.checkpoint: recomputed in the backward (issue 14, part 6)
    casts = compat.autocast_states()
    per_rank = running_stat_buffers(gm, inputs)
    if casts or any(compat.is_autocast_node(n) for n in gm.graph.nodes):
        # traced into ATen first, BatchNorm would be vmap's (per rank, updating buffers vmap cannot batch)
        calls = [n for n, running in _batch_norm_calls(gm) if running or batch_norm == "sync"]
        if calls:
            raise CaptureError(f"BatchNorm in training mode ({calls[0].name}) with running statistics or "
                               f"batch_norm='sync' under torch.autocast is not supported by the adaptdist backend "
                               "yet: run BatchNorm outside the autocast region, or train with adaptdist train")
        gm = _with_explicit_casts(gm, inputs)
    from .expert_batching import with_rank_bmm

    # batched matmuls against stacked [E, ...] weights keep the expert dim apart from the rank dim (issue 14, ep)
    gm = with_rank_bmm(gm, {ph.name for ph, i in zip(gm.graph.find_nodes(op="placeholder"), inputs)
                            if i.kind == "param"})
    outputs = _graph_outputs(gm)
    # Every floating-point output takes a tangent, also under no_grad() (an eval loop): the program's
    # forward part is then all that runs, and it is the same as in training.
    # ... that depends on an input requiring grad: a buffer's in-place update (``self.n += 1``, returned
    # by Dynamo as an output) takes none, or its new value would carry this step's backward into the next
    reached = _outputs_reached_from_grad_inputs(gm, inputs)
    tangent_outputs = [k for k, o in enumerate(outputs)
                       if isinstance(o, torch.Tensor) and o.is_floating_point() and k in reached]
    if not tangent_outputs or not any(i.requires_grad for i in inputs):
        raise CaptureError("no floating-point output or no parameter that requires grad in the compiled graph: "
                           "nothing the adaptdist backend would split (it compiles training steps); run this part "
                           "without torch.compile, or with another backend")
    step = _AllRanksStep(_with_batch_norm_rows(gm, batch_norm), inputs, tangent_outputs, world_size, per_rank)
    mode = compat.fake_tensor_mode(allow_constants=True)
    with mode:
        for i in inputs:
            if i.kind in ("param", "buffer"):
                t = torch.empty(i.global_shape, dtype=i.dtype, device=i.device)
                step.state.put(i.fqn, nn.Parameter(t, requires_grad=i.requires_grad) if i.kind == "param" else t,
                               i.kind == "param")
        batch = [torch.empty((world_size, *i.global_shape), dtype=i.dtype, device=i.device)
                 .requires_grad_(i.requires_grad) for i in inputs if i.kind == "input"]
        batch += [torch.empty((world_size, *outputs[k].shape), dtype=outputs[k].dtype, device=outputs[k].device)
                  for k in tangent_outputs]
    unused: list[str] = []
    with _gc_paused(), mode, compat.sdpa_math_only(), compat.autocast_disabled():
        try:
            try:
                joint, sig = compat.aot_export_joint(step, tuple(batch), loss_index=0)
            except Exception as e:
                # parameters the outputs do not reach (a pooler whose output is dropped): as DDP's
                # find_unused_parameters, frozen for this graph: no gradient (.grad stays None, as in eager)
                unused = _params_without_gradient(step, batch) if "did not receive a gradient" in str(e) else []
                if not unused:
                    raise
                for f in unused:
                    step.state.get_parameter(f).requires_grad_(False)
                joint, sig = compat.aot_export_joint(step, tuple(batch), loss_index=0)
        except Exception as e:
            msg = str(e).split("\n")[0].rstrip(".")
            hint = _vmap_capture_hint(msg.lower(), _autograd_function_sites(gm))
            raise CaptureError(f"cannot capture the compiled graph for {world_size} ranks at once: "
                               f"{type(e).__name__}: {msg}. {hint}") from e
    by_name = {n.name: n for n in joint.graph.output_node().args[0] if isinstance(n, torch.fx.Node)}
    recompute_regions(joint, [by_name[n] for n in list(sig.user_outputs[1:]) + list(sig.buffers_to_mutate)
                              if n in by_name], by_name[sig.user_outputs[0]])
    captured = _finish(joint, sig, len(outputs), world_size, per_rank)
    captured.unused_param_fqns = [f for f in unused if f in captured.frozen_param_fqns]
    if rng == "global":
        from .eager_batch import annotate_eager_batch

        annotate_eager_batch(step.gm, inputs, captured.gm.graph, world_size)
    return captured, tangent_outputs


def _params_without_gradient(step: nn.Module, batch: Sequence[torch.Tensor]) -> list[str]:
    """The parameters of the all-ranks ``step`` that require grad but get none from its loss (run on the fake
    ``batch``); [] when that run fails (the export's error is the one to report)."""
    params = {n: p for n, p in step.state.named_parameters() if p.requires_grad}
    try:
        loss = step(*batch)[0]
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    except Exception:  # noqa: BLE001
        return []
    return [n for n, g in zip(params, grads) if g is None]


RNN_OPS = ("rnn_tanh", "rnn_relu", "gru", "lstm")
"""ATen's fused recurrent ops (nn.RNN/GRU/LSTM), which torch.vmap cannot batch."""

_OTHER_FRONT_ENDS = "`adaptdist train` (or `compile` + `run`), which captures one rank's program, or DistributedDataParallel"


def _autograd_function_sites(gm: torch.fx.GraphModule) -> list[str]:
    """Where the user's code calls a custom ``torch.autograd.Function`` (``Fn.apply(...)``) in Dynamo's graph
    ``gm``, as ``file:line: code`` from each ``autograd_function_apply`` node's stack trace (Dynamo's error names
    only its generated ``ApplyTemplate``), in graph order, without repeats."""
    sites: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or "autograd_function_apply" not in f"{n.target} {type(n.target).__name__}".lower():
            continue
        frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', n.meta.get("stack_trace") or "")
        site = f"{frames[-1][0]}:{frames[-1][1]}: {frames[-1][2].strip()}" if frames else n.name
        if site not in sites:
            sites.append(site)
    return sites


def _vmap_capture_hint(low: str, function_sites: Sequence[str] = ()) -> str:
    """What to try when capturing every rank's call at once under torch.vmap failed with message ``low``
    (lower-cased); ``function_sites`` are where the graph calls custom autograd Functions
    (:func:`_autograd_function_sites`)."""
    if any(w in low for w in ("inplace", "in-place", "running_mean", "running_var",
                              "doesn't match the broadcast shape")):
        return ("A buffer updated in the forward from each rank's rows (other than BatchNorm's running statistics, "
                f"which the backend updates) cannot be updated per rank: update it outside the compiled code, or use "
                f"{_OTHER_FRONT_ENDS}.")
    if "batching rule not implemented" in low and any(f"aten::{op}" in low for op in RNN_OPS):
        return (f"torch.vmap, which captures every rank's call at once, has no batching rule for this RNN op: train "
                f"RNNs (nn.RNN/GRU/LSTM) with {_OTHER_FRONT_ENDS}.")
    if "applytemplate" in low or "generate_vmap_rule" in low or "autograd.function" in low:
        called = f" (called at {'; '.join(function_sites)})" if function_sites else ""
        return (f"A custom torch.autograd.Function{called} cannot be captured for every rank at once here, whatever its "
                "generate_vmap_rule or vmap staticmethod (torch's advice above does not apply inside this capture): "
                f"write it with plain torch ops, or train the model with {_OTHER_FRONT_ENDS}.")
    if "internal assert" in low:
        return (f"torch.vmap failed inside PyTorch on this model: train it with {_OTHER_FRONT_ENDS}.")
    return f"Check that the model runs eagerly and under torch.vmap; else use {_OTHER_FRONT_ENDS}."


def _with_explicit_casts(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> torch.fx.GraphModule:
    """One rank's Dynamo graph traced into ATen ops under the autocast state in effect (an enclosing
    ``torch.autocast`` and any region inside the compiled code): every cast autocast makes becomes an explicit
    ``_to_copy`` node, and the autocast regions inside the graph are gone.

    Why: the all-ranks capture runs the graph under ``torch.vmap``, whose batching rules sit above autocast in
    torch's dispatcher and decompose ops before autocast sees them (``linear`` -> ``mm`` + bias ``add``: the
    ``mm`` is cast to bf16 and the ``add`` promotes it back to float32, so the output was float32 and the
    numbers differed from eager under autocast). Traced one rank at a time, outside vmap, autocast sees each
    op as eager's dispatcher does; the traced graph is then vmapped, and the joint graph exported, with
    autocast off (:func:`~adaptdist._torch_compat.autocast_disabled`), so its backward is traced without
    autocast, as eager's ``loss.backward()`` outside the ``autocast`` block runs it. Dynamo guards on the
    autocast state, so a call with autocast off (or another dtype) compiles its own graph."""
    mode = compat.fake_tensor_mode(allow_constants=True)
    with mode:
        args = [torch.empty(i.global_shape, dtype=i.dtype, device=i.device).requires_grad_(i.requires_grad)
                for i in inputs]
    with _gc_paused(), mode, compat.sdpa_math_only():
        try:
            return compat.retrace_aten(gm, args)
        except Exception as e:
            raise CaptureError(f"cannot trace the compiled graph under autocast {compat.autocast_states()}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Check that the "
                               "model runs eagerly under the same torch.autocast") from e


def _mark_rank_dims(graph: torch.fx.Graph, world_size: int) -> None:
    """Mark the nodes whose dim 0 is the rank dim (:data:`adaptdist.graph_meta.RANK_DIM`), so error messages
    show one rank's shape. A value is *rank-major* when its dim 0 holds the ranks' rows in rank order (size
    ``world_size * k``): the stacked inputs and tangents, a view of a rank-major value whose dim 0 divides or
    is divided by the input's, a transpose/permute that keeps dim 0, any other op with a rank-major input of
    the same dim 0 size; those with dim 0 of size ``world_size`` are marked."""
    aten = torch.ops.aten
    views = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
    moves = {aten.t.default, aten.transpose.int, aten.permute.default}
    major: set[torch.fx.Node] = set()

    def rows(n: Any) -> int | None:
        v = gmeta.val(n) if isinstance(n, torch.fx.Node) else None
        return int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() > 0 else None

    for n in graph.nodes:
        out = rows(n)
        if n.op == "placeholder":
            if gmeta.get_role(n) == "batch":
                major.add(n)
        elif n.op == "call_function" and out is not None and out % world_size == 0:
            ins = [a for a in n.all_input_nodes if a in major]
            if n.target in moves:
                dims = list(n.args[1:]) if n.target != aten.permute.default else [n.args[1][0]]
                keeps = n.target == aten.permute.default and dims == [0] or (
                    n.target == aten.transpose.int and 0 not in [d % max(1, gmeta.val(n).dim()) for d in dims])
                ok = bool(ins) and keeps
            elif n.target in views:
                ok = any(rows(a) and (rows(a) % out == 0 or out % rows(a) == 0) for a in ins[:1])
            else:
                ok = any(rows(a) == out for a in ins)
            if ok:
                major.add(n)
        if n in major and out == world_size:
            gmeta.mark_rank_dim(n)


def _finish(gm: torch.fx.GraphModule, sig: Any, n_outputs: int, world_size: int,
            per_rank_buffers: Sequence[str] = ()) -> CapturedGraph:
    graph = gm.graph
    strip = len("state.")
    user_ph = list(sig.user_inputs)
    set_input_roles(graph, sig, strip)
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    by_name = {n.name: n for n in outs if isinstance(n, torch.fx.Node)}
    bw = sig.backward_signature
    loss = by_name[sig.user_outputs[0]]
    forward_outs = [by_name[n] for n in sig.user_outputs[1:1 + n_outputs]]
    grad_of = {p[strip:]: by_name[g] for g, p in bw.gradients_to_parameters.items()}
    grad_in = {user_ph.index(u): by_name[g] for g, u in bw.gradients_to_user_inputs.items()}
    params = [gmeta.get_fqn(p) for p in graph.find_nodes(op="placeholder") if gmeta.get_role(p) == "param"]
    trainable = [f for f in params if f in grad_of]
    frozen = [f for f in params if f not in grad_of]
    by_fqn = {gmeta.get_fqn(p): p for p in graph.find_nodes(op="placeholder") if gmeta.get_role(p) == "param"}
    summed = sum_cast_gradients_in_low_precision(gm, {by_fqn[f]: grad_of[f] for f in trainable})
    grad_of.update({gmeta.get_fqn(p): g for p, g in summed.items()})  # a parameter used twice, autocast (as capture)
    # updated buffers: those updated in place the same on every rank (num_batches_tracked += 1), then rank 0's
    # new value of those each rank updates from its rows (the step's last outputs)
    mutated = {b[strip:]: by_name[o] for o, b in sig.buffers_to_mutate.items()}
    overlap = set(mutated) & set(per_rank_buffers)
    assert not overlap, f"buffers both per rank and mutated in place: {sorted(overlap)}"
    first = 1 + n_outputs
    mutated.update({f: by_name[n] for f, n in zip(per_rank_buffers, sig.user_outputs[first:first + len(per_rank_buffers)])})
    new_outs = [loss] + [grad_of[f] for f in trainable] + forward_outs + [grad_in[k] for k in sorted(grad_in)]
    new_outs += list(mutated.values())
    roles = (["loss"] + [f"grad:{f}" for f in trainable] + [f"out:{k}" for k in range(len(forward_outs))]
             + [f"grad_in:{k}" for k in sorted(grad_in)] + [f"buffer:{f}" for f in mutated])
    out_node.args = (tuple(new_outs),)
    gmeta.set_output_roles(out_node, roles)
    ranked = order_placeholders(graph, set(frozen))
    fold_unit_scalings(gm)  # vmap's addmm: mul(bias, 1), which hid each bias from fsdp's bucketed gathers
    fold_contiguous_as_strided(gm)  # as_strided ops that are reshapes (Swin's pooler): shardable as views
    fold_batch_arange_index(gm)  # HF masks' m[arange(B), kv]: row b from row b, the batch split kept
    graph.eliminate_dead_code()
    _mark_rank_dims(graph, world_size)
    graph.lint()
    gm.recompile()
    return CapturedGraph(
        gm=gm, param_fqns=trainable, frozen_param_fqns=frozen,
        buffer_fqns=[gmeta.get_fqn(p) for p in ranked if gmeta.get_role(p) == "buffer"],
        num_batch_inputs=len(user_ph), mutated_buffer_fqns=list(mutated), loss_output_index=0,
        grad_output_index={f: 1 + i for i, f in enumerate(trainable)}, batch_size=world_size,
        model_name="compiled graph",
    )
