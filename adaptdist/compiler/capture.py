"""Capture: a model, an example batch and a loss function -> one joint ATen graph.

The joint graph computes, for one global batch, the loss and the gradient of
every trainable parameter, with the loss function inside it (so later passes
see exactly how the loss reduces over the batch). It is captured with
``aot_export_module(trace_joint=True)`` under a FakeTensorMode, so capture
needs no real memory and works the same for real, fake and meta models.

Batch contract: ``batch`` is a tuple of tensors whose last element is the
target; the step computes ``loss_fn(model(*batch[:-1]), batch[-1])``. Every
batch tensor has the batch on dim 0.

Graph contract (what every pass may rely on):
    placeholders = [params..., buffers..., batch...] (roles in node.meta)
    outputs      = (mutated buffers..., loss, grads of params...)
Tied parameters (the same tensor under two names, or one module under two
names) appear once, under their first name (``CapturedGraph.tied`` maps the
others to it); autograd sums their uses' gradient contributions, as in eager.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import CaptureError
from .expert_lists import ExpertLists, batched_experts, fold_stack_of_unbind, probe_expert_lists
from .autocast_grad_sums import sum_cast_gradients_in_low_precision
from .batch_arange_index import fold_batch_arange_index
from .batch_inner_merges import reorder_batch_inner_merges
from .strided_views import fold_contiguous_as_strided

log = logging.getLogger("adaptdist.compiler")


@dataclass
class CapturedGraph:
    """The joint forward+backward graph of one training step, and what its inputs/outputs are.

    Attributes:
        gm: GraphModule with fake values in ``node.meta["val"]`` (global shapes).
        param_fqns: trainable parameter names, in placeholder order.
        frozen_param_fqns: parameters with ``requires_grad=False`` (inputs, no gradient).
        buffer_fqns: buffer names, in placeholder order (after the parameters).
        num_batch_inputs: number of batch tensors (after the buffers).
        mutated_buffer_fqns: buffers the step updates, in output order (outputs first).
        loss_output_index: index of the scalar loss among the outputs.
        grad_output_index: {param fqn: output index of its gradient}.
        batch_size: size of dim 0 shared by all batch tensors.
        model_name: class name of the captured model (for messages).
        tied: {name: the name it is captured under} for tied parameters.
        stacked: {stacked name: [the E user names]} for experts written as a ModuleList, captured as one
            ``[E, ...]`` parameter (``moe.experts.*.fc.weight``; :mod:`.expert_lists`).
        notes: one line per ModuleList of identical modules not captured as experts, saying why.
        unused_param_fqns: trainable parameters the loss does not reach (no gradient: eager's ``.grad`` stays
            None); captured as frozen inputs (also in ``frozen_param_fqns``), so every optimizer leaves them as
            they are, as eager's does.
    """

    gm: torch.fx.GraphModule
    param_fqns: list[str]
    frozen_param_fqns: list[str]
    buffer_fqns: list[str]
    num_batch_inputs: int
    mutated_buffer_fqns: list[str]
    loss_output_index: int
    grad_output_index: dict[str, int]
    batch_size: int
    model_name: str
    tied: dict[str, str] = field(default_factory=dict)
    stacked: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unused_param_fqns: list[str] = field(default_factory=list)

    @property
    def input_fqns(self) -> list[str]:
        """Names of the state inputs (params, frozen params, buffers) in placeholder order."""
        return [gmeta.get_fqn(n) for n in self.gm.graph.find_nodes(op="placeholder") if gmeta.get_role(n) != "batch"]


class _TrainStep(nn.Module):
    """model + loss_fn as one module whose single output is the loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        # Not a submodule: a loss module's tensors (class weights) are constants of the step.
        object.__setattr__(self, "loss_fn", loss_fn)

    def forward(self, *batch):
        return (self.loss_fn(self.model(*batch[:-1]), batch[-1]),)


class _EachParameterOnce(nn.Module):
    """The step with each parameter registered once, under its first name: what the exporter traces.

    ``aot_export_module`` makes a graph input of every *name* of a parameter
    (``named_parameters(remove_duplicate=False)``) and swaps each name in for the trace. A parameter under
    several names then becomes several inputs, and (1) a name the forward never reads (HF T5's
    ``shared.weight``: its encoder and decoder read it as ``embed_tokens.weight``) receives no gradient,
    which aot refuses ("Found a parameter that did not receive a gradient"); (2) a module registered under
    two names (``self.b = self.a``) has one slot, which aot's swaps overwrite and then restore in swap
    order, leaving a traced tensor in the model ("Attempting to use FunctionalTensor on its own"). Here
    the exporter sees each parameter once; the forward puts it in under all its names (restored in
    reverse order), so the gradients of its uses sum in autograd, as in eager. A buffer is one input per
    slot: a module under two names has one (BatchNorm's running statistics, updated once: two inputs of one
    mutated tensor are refused by aot), a tensor registered as two buffers has two.
    """

    def __init__(self, step: nn.Module, experts: "ExpertLists | None" = None):
        super().__init__()
        object.__setattr__(self, "step", step)  # not a submodule: the exporter sees only what is registered here
        self.names = state_aliases(step)  # every name in step -> the name it is registered under here
        self.experts = experts if experts is not None else ExpertLists()
        stacked = self.experts.stacked()
        members = {m for ms in stacked.values() for m in ms}
        named = dict(step.named_parameters(remove_duplicate=False))
        for n, p in named.items():
            if self.names[n] == n and n not in members:
                _register(self, n, p, param=True)
        for s, ms in stacked.items():  # one [E, ...] parameter per expert parameter name (expert_lists.py)
            _register(self, s, nn.Parameter(torch.stack([named[m].detach() for m in ms])), param=True)
        self.names = {n: k for n, k in self.names.items() if n not in members}
        for n, b in step.named_buffers(remove_duplicate=False):
            if self.names[n] == n:
                _register(self, n, b, param=False)

    def forward(self, *batch):
        mine = dict(self.named_parameters(remove_duplicate=False))
        mine.update(self.named_buffers(remove_duplicate=False))
        swap = {n: mine[k] for n, k in self.names.items()}
        # an expert's parameter read outside its forward (an auxiliary loss, a dtype check) is its row of the
        # stacked one: autograd takes that use's gradient there too (unused rows are dead code, removed)
        swap.update({m: mine[s][i] for s, ms in self.experts.stacked().items() for i, m in enumerate(ms)})
        with compat.reparametrize(self.step, swap, tie_weights=False), \
                batched_experts(self.step, self.experts.lists, {s: mine[s] for s in self.experts.stacked()}):
            return self.step(*batch)


def _register(root: nn.Module, fqn: str, value: torch.Tensor, param: bool) -> None:
    """Register ``value`` as ``root``'s parameter (or buffer) ``fqn``, creating empty modules on the path."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if param:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def state_aliases(module: nn.Module) -> dict[str, str]:
    """Every parameter and buffer name of ``module`` -> the name it is captured under: a parameter's first
    name (one tensor under several: shared by two modules, or a module under two names), a buffer's first
    name for its slot (its module and attribute: a module under two names)."""
    names: dict[str, str] = {}
    first: dict[Any, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names[n] = first.setdefault(id(p), n)
    for n, b in module.named_buffers(remove_duplicate=False):
        prefix, _, leaf = n.rpartition(".")
        names[n] = first.setdefault((id(module.get_submodule(prefix)), leaf), n)
    return names


def tied_names(module: nn.Module, strip: int = 0) -> dict[str, str]:
    """{name: captured name} for every name of ``module``'s state that is not captured under its own (see
    :func:`state_aliases`), the first ``strip`` characters of each dropped."""
    return {n[strip:]: k[strip:] for n, k in state_aliases(module).items() if n != k}


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch and adaptdist: the user's construct (None: every frame is
    torch's or adaptdist's, e.g. a model that is a torch module itself, or a torch loss function)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" not in f and "/adaptdist/compiler/" not in f and "<eval_with_key>" not in f:
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    return None


def _where(exc: BaseException, step: nn.Module) -> str:
    """Where ``exc`` was raised in the step, for a message: ``at FILE:LINE in FN: CODE in module 'q' (Linear)``
    (the user's frame, and the module whose forward was running); without a user frame (only torch's code on the
    traceback), the part that failed by name: ``in module '2' (Linear(...))``, ``in the model's own forward
    (Linear(...))``, ``in the loss function cross_entropy (called as loss_fn(model output, last batch tensor))``
    or ``calling the model Net on the batch's inputs``."""
    frame, module = _user_frame(exc), _failing_module(exc, step)
    if frame is not None:
        return f"at {frame}{module}"
    if module:
        return module.lstrip()
    model = getattr(step, "model", None)
    tb, in_model, in_module_forward = exc.__traceback__, False, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if model is not None and owner is model:
            in_model = True
            if tb.tb_frame.f_code.co_name == "forward":
                in_module_forward = owner
        tb = tb.tb_next
    if in_module_forward is not None:
        return f"in the model's own forward ({_short(model)})"
    if in_model:
        return f"calling the model {type(model).__name__} on the batch's inputs (its forward's arguments)"
    loss_fn = getattr(step, "loss_fn", None)
    if loss_fn is not None:
        return (f"in the loss function {getattr(loss_fn, '__name__', None) or type(loss_fn).__name__} (called as "
                "loss_fn(model output, last batch tensor))")
    return "in the model"


def _short(m: nn.Module) -> str:
    """``repr(m)`` when it fits in 80 characters, else its class name."""
    return repr(m) if len(repr(m)) <= 80 else type(m).__name__


def _what_to_try(where: str) -> str:
    """What to try after a failed eager run of the step, for the part ``where`` names."""
    if where.startswith("in the loss function"):
        return ("Check that loss_fn(model(*batch[:-1]), batch[-1]) runs eagerly on this batch: the factory's loss "
                "takes the model's output and the batch's last tensor (the target), in that order")
    if where.startswith("calling the model"):
        return ("Check that model(*batch[:-1]) runs eagerly on this batch: every batch tensor but the last is an "
                "argument of the model's forward")
    return ("Check that the model runs eagerly on this batch (model(*batch[:-1])): the input shapes and dtypes "
            "that module receives")


def _failing_module(exc: BaseException, step: nn.Module) -> str:
    """`` in module '2' (Linear(in_features=64, ...))``: the innermost module whose ``forward`` was running when
    ``exc`` was raised (the user's frame may be torch's: nn.Sequential's loop), named as in the model; "" if none."""
    names = {id(m): n.removeprefix("model.") for n, m in step.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "forward" and isinstance(owner, nn.Module) and id(owner) in names:
            found = owner
        tb = tb.tb_next
    if found is None or not names[id(found)] or names[id(found)] == "model":
        return ""
    return f" in module {names[id(found)]!r} ({_short(found)})"


def _torch_module_hint(exc: BaseException) -> str:
    """Where the data-dependent read is inside torch's own modules, which one and why: "" otherwise."""
    files = [fr.filename.replace("\\", "/") for fr in traceback.extract_tb(exc.__traceback__)]
    if any(f.endswith("torch/nn/modules/batchnorm.py") for f in files):
        return (", inside torch's BatchNorm: momentum=None (the cumulative average) reads float(num_batches_tracked); "
                "give the BatchNorm a numeric momentum")
    return ""


def _check_batch(batch: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(batch, torch.Tensor):
        raise CaptureError(
            "the example batch is a single tensor; pass a tuple (inputs..., target) so the loss "
            "function receives the target"
        )
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise CaptureError(
            f"the example batch must be a tuple (inputs..., target) of at least 2 tensors, got {type(batch).__name__}"
        )
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise CaptureError(f"batch element {i} is a {type(t).__name__}, not a tensor; pass tensors only")
        if t.dim() == 0:
            raise CaptureError(f"batch element {i} is a 0-d tensor; every batch tensor needs the batch on dim 0")
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1:
        raise CaptureError(
            f"batch tensors disagree on dim 0 (the batch dim): shapes {[list(t.shape) for t in batch]}; "
            "every batch tensor must have the batch on dim 0"
        )
    return tuple(batch)


def _to_fake(mode: Any, t: torch.Tensor) -> torch.Tensor:
    if compat.is_fake(t):
        return t
    if t.device.type == "meta":
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return mode.from_tensor(t)


def capture(model: nn.Module, batch: tuple, loss_fn: Callable) -> CapturedGraph:
    """Capture ``loss_fn(model(*batch[:-1]), batch[-1])`` and its backward as one joint graph.

    Args:
        model: the module; its parameters may be real, meta or fake tensors.
        batch: tuple of tensors, the last is the target; dim 0 of each is the batch.
        loss_fn: ``(model_output, target) -> scalar tensor``.

    Returns:
        CapturedGraph with global (unsharded) shapes in ``node.meta["val"]``.

    Raises:
        CaptureError: bad batch, a loss that is not a scalar, or a construct the tracer
            cannot follow; names the module and the source line, and says what to try.
            A trainable parameter the loss does not reach is no error: it is captured as
            frozen (``CapturedGraph.unused_param_fqns``) and named in one logged line.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise CaptureError(f"the loss function must be callable, got {type(loss_fn).__name__}")
    batch = _check_batch(batch)
    name = type(model).__name__
    step = _TrainStep(model, loss_fn)
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError(
            f"{name} has no trainable parameters (none with requires_grad=True): there is nothing to train"
        )
    mode = compat.fake_tensor_mode(allow_constants=True)
    state: dict[str, torch.Tensor] = {}
    for n, p in step.named_parameters():
        state[n] = nn.Parameter(_to_fake(mode, p.detach()), requires_grad=p.requires_grad)
    for n, b in step.named_buffers():
        state[n] = _to_fake(mode, b)
    fake_batch = tuple(_to_fake(mode, t) for t in batch)

    with _gc_paused(), compat.quiet_fake_tensor_errors():  # a failing op is reported once, by _check_step
        with mode, compat.reparametrize(step, state), compat.compile_session():  # library code traces its graph-safe path
            # Export first; only when that fails, run the step eagerly (on the same fake tensors)
            # to tell a model or loss at fault from a construct the exporter cannot follow. A
            # model or loss that fails the eager run fails the export too, so the messages are
            # those of checking first, without a third forward pass when all is well (the loss
            # of a successful export is checked on its graph, in _finish).
            experts = probe_expert_lists(step, fake_batch, strip=len("model."))
            try:
                gm, sig = compat.aot_export_joint(_EachParameterOnce(step, experts), fake_batch, 0, model)
                failure = None
            except Exception as e:
                failure = e
            unused: list[str] = []
            if failure is not None and "did not receive a gradient" in str(failure):
                # parameters the loss does not reach (a pooler, a head this loss skips): DDP's
                # find_unused_parameters. Captured as frozen inputs: no gradient, no optimizer state, left as they
                # are by every optimizer, as eager's (whose .grad stays None); kept in the state and checkpoints
                unused = _params_without_gradient(step, fake_batch)
                if len(unused) == sum(1 for p in state.values() if isinstance(p, nn.Parameter) and p.requires_grad):
                    unused = []  # the loss reaches no parameter: nothing to train (the error below says so)
                if unused:
                    for f in unused:
                        state[f"model.{f}"].requires_grad_(False)
                    try:
                        gm, sig = compat.aot_export_joint(_EachParameterOnce(step, experts), fake_batch, 0, model)
                        failure = None
                    except Exception as e:
                        failure = e
            if failure is not None and experts.lists:  # batching the experts failed: capture them as they are
                why = f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:200]}"
                experts = ExpertLists(notes=experts.notes + [
                    f"{el.prefix[len('model.'):]} ({el.size} identical modules) is not sharded as experts: running "
                    f"them batched failed ({why})" for el in experts.lists])
                try:
                    gm, sig = compat.aot_export_joint(_EachParameterOnce(step, experts), fake_batch, 0, model)
                    failure = None
                except Exception as e:
                    failure = e
            if failure is not None:
                _check_step(step, fake_batch, batch, name)
                no_grad = (_params_without_gradient(step, fake_batch)
                           if "did not receive a gradient" in str(failure) else [])
                raise _export_error(failure, name, no_grad, step) from failure
        captured = _finish(gm, sig, step, batch, name, experts)
    if unused:
        captured.unused_param_fqns = [f for f in unused if f in captured.frozen_param_fqns]
        log.warning("adaptdist: %s", unused_params_line(name, captured.unused_param_fqns))
    return captured


def unused_params_line(name: str, unused: list[str], source: str = "the loss") -> str:
    """The one line that says which trainable parameters of model ``name`` ``source`` does not reach."""
    shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
    return (f"{len(unused)} trainable parameter(s) of {name} receive no gradient from {source} ({shown}): "
            "trained as unused (as DDP's find_unused_parameters=True): no gradient, kept unchanged by the "
            "optimizer as in eager (where their .grad stays None), saved in checkpoints")


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for the duration: tracing creates millions of
    objects, and every full collection walks all of them (about a second on an 8B model)
    to find nothing; garbage left meanwhile is collected once the collector is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_loss(loss: Any, name: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"shape {list(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CaptureError(
            f"the loss function must return a floating-point scalar, got {got} for model {name}; "
            "reduce it with .mean() or .sum()"
        )


def data_dependent_message(name: str, where: str) -> str:
    """What to say about an op whose output shape depends on the data (``nonzero``, ``torch.where(mask)``,
    ``masked_select``, ``unique``; Mixtral-style per-expert token selection) in model ``name`` at ``where``."""
    if "pack_padded_sequence" in where or "pack_sequence" in where:  # aten._pack_padded_sequence
        return (f"{name} packs a batch of sequences for an RNN {where}: a PackedSequence's shapes depend on the "
                "lengths (data), and adaptdist plans and lowers static shapes only. Pass the padded batch to the "
                "RNN itself (no pack_padded_sequence; a bidirectional RNN's reverse direction then reads the "
                "padding too), then mask the padded steps where you use its outputs (a mean over the valid steps: (h * mask).sum(1) / mask.sum(1); each row's "
                "last valid step: h.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, 1, h.shape[-1])))")
    return (f"{name} has an op whose output shape depends on the data {where}: adaptdist plans and lowers "
            "static shapes only, so it cannot compile data-dependent token counts (e.g. an MoE that picks each "
            "expert's tokens with torch.where / nonzero, then index_add_). Write it with static shapes: dense "
            "dispatch (every expert on every token, weighted by the router's zero-masked weights; see "
            "adaptdist/models/moe.py), or a fixed capacity per expert" + _hf_experts_hint(where))


def _hf_experts_hint(where: str) -> str:
    """For a Hugging Face MoE (the op in ``transformers/``): its ``experts_implementation`` setting picks the
    experts' code; ``batched_mm`` runs every expert on every token with static shapes, which the backend lowers
    under auto, dp, fsdp and ep equal to eager (issue 14, checked on Mixtral's block; the default of a model built
    from a config, ``grouped_mm``, calls an op with no sharding rule, and the eager loop is the per-expert
    ``torch.where`` this message is about)."""
    if "transformers" not in where:
        return ""
    return ("; a Hugging Face model: build it with experts_implementation='batched_mm' in its config (static shapes: "
            "every expert on every token)")


def _check_step(step: nn.Module, fake_batch: tuple, batch: tuple, name: str) -> None:
    """Run the step on fake tensors; raise a CaptureError naming the user's failing line, or a bad loss."""
    try:
        (loss,) = step(*fake_batch)
    except Exception as e:  # the user's code failed: report where
        if _is_data_dependent(e):
            if "DynamicOutputShapeException" in f"{type(e).__name__} {e}":  # nonzero, torch.where(mask), x[mask]
                raise CaptureError(data_dependent_message(name, f"{_where(e, step)} ({e})")) from e
            raise CaptureError(
                f"cannot capture {name}: a tensor's values decide Python control flow or a shape "
                f"{_where(e, step)}{_torch_module_hint(e)} ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}): a branch on data "
                "(`if t.sum() > 0`, `t.item()`) or a data-dependent shape (`x[mask]`, `nonzero`). adaptdist train "
                "captures one graph for every step, which would bake in what this example batch does, so it "
                "refuses. Compute both sides and select with torch.where(cond, a, b) (or multiply by a mask), "
                "decide from something fixed (a Python flag, a parameter's shape), or train with "
                "torch.compile(model, backend='adaptdist'), where a branch on data is a graph break."
            ) from e
        where = _where(e, step)
        raise CaptureError(
            f"running {name} on the example batch {[list(t.shape) for t in batch]} failed {where}: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. {_what_to_try(where)}."
        ) from e
    _check_loss(loss, name)


def _params_without_gradient(step: nn.Module, fake_batch: tuple) -> list[str]:
    """The trainable parameters (each under its first name, ``model.`` dropped) whose gradient from the
    step's loss is None: eager's ``.grad`` stays None for them."""
    named = dict(step.named_parameters())
    params = [p for p in named.values() if p.requires_grad]
    try:
        (loss,) = step(*fake_batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    except Exception:  # the export's error is the one to report
        return []
    unused = {id(p) for p, g in zip(params, grads) if g is None}
    return [n[len("model."):] for n, p in named.items() if id(p) in unused]


def _is_data_dependent(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it came from) is the fake-tensor run refusing a value that depends on a
    tensor's data (``bool(t)``, ``t.item()``, ``t.tolist()``, a data-dependent output shape)."""
    seen = 0
    while e is not None and seen < 8:
        text = f"{type(e).__name__}: {e}"
        if any(w in text for w in ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                                   "_local_scalar_dense", "DynamicOutputShapeException", "data-dependent")):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _export_error(e: Exception, name: str, no_grad: list[str] | None = None, step: nn.Module | None = None
                  ) -> CaptureError:
    msg = str(e).split("\n")[0]
    hint = "Try removing data-dependent Python control flow or in-place ops on inputs in that code."
    if "did not receive a gradient" in str(e):
        no_grad = no_grad or []
        shown = ", ".join(no_grad[:8]) + (f" and {len(no_grad) - 8} more" if len(no_grad) > 8 else "")
        return CaptureError(
            f"cannot capture {name}: "
            + (f"{len(no_grad)} trainable parameter(s) receive no gradient from the loss ({shown})" if no_grad else
               "a trainable parameter receives no gradient from the loss")
            + ": the loss does not depend on them. Set requires_grad=False "
            "on them (they are then kept as they are, as eager's optimizer skips a parameter whose .grad is "
            "None), or remove them from the model.")
    if "requires gradients, and received a mutation" in str(e):
        renorm = [n.removeprefix("model.") for n, m in (step.named_modules() if step is not None else ())
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
        return CaptureError(
            f"cannot capture {name}: a trainable parameter is changed in place inside the forward"
            + (f" (nn.Embedding(max_norm=...) renormalizes its weight in the forward: {', '.join(renorm)})"
               if renorm else "") + "; adaptdist captures the step as a function of the parameters, which the "
            "optimizer alone updates. Drop max_norm and renormalize after each optimizer step (under "
            "torch.no_grad()), or do the in-place change on a copy (weight = self.weight * scale)."
            f" ({type(e).__name__}: {msg})")
    if "gradients_to_parameters" in msg and "backward_output_names" in msg:
        # aot's signature keys gradients by node name: two parameters given one gradient node collapse into one.
        # aot_export_joint clones such repeats (nn.LSTM's biases under oneDNN); one reaching here is some other op
        rnns = [f"{n.removeprefix('model.')} ({type(m).__name__})" for n, m in
                (step.named_modules() if step is not None else ()) if isinstance(m, nn.RNNBase)]
        hint = ("The exporter gave two parameters one gradient tensor (a fused kernel's backward"
                + (f"; this model's RNNs: {', '.join(rnns)}" if rnns else "") + "), which its signature cannot "
                "tell apart: a bug in adaptdist's capture (adaptdist/_torch_compat.py aot_export_joint), not in "
                "your code; please report it with the model.")
    return CaptureError(
        f"cannot capture {name} as one joint forward+backward graph; failed "
        f"{_where(e, step) if step is not None else 'at ' + (_user_frame(e) or 'a frame of torch (no model code)')}: "
        f"{type(e).__name__}: {msg}. {hint}"
    )


def _finish(gm: torch.fx.GraphModule, sig: Any, step: nn.Module, batch: tuple, name: str,
            experts: ExpertLists | None = None) -> CapturedGraph:
    experts = experts if experts is not None else ExpertLists()
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    strip = len("model.")
    set_input_roles(graph, sig, strip)
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    name_to_out = {n.name: i for i, n in enumerate(outs) if isinstance(n, torch.fx.Node)}
    bw = sig.backward_signature
    grad_of: dict[str, torch.fx.Node] = {
        p[strip:]: outs[name_to_out[g]]
        for g, p in bw.gradients_to_parameters.items()
    }
    mutated = [outs[name_to_out[o]] for o in sig.buffers_to_mutate]
    mutated_fqns = [sig.buffers_to_mutate[o][strip:] for o in sig.buffers_to_mutate]
    # The step's only user output is the loss. torch 2.13's backward signature names the wrong output as
    # loss_output when buffers are mutated (the first mutated buffer: measured with BatchNorm), so the
    # user output is what counts.
    loss_name = sig.user_outputs[0] if getattr(sig, "user_outputs", None) else bw.loss_output
    loss_node = outs[name_to_out[loss_name]]
    if isinstance(loss_node.meta.get("val"), torch.Tensor):
        _check_loss(loss_node.meta["val"], name)

    # Tied parameters are one input already, under the first name (_EachParameterOnce).
    stacked = experts.stacked(strip)
    members = {m for ms in stacked.values() for m in ms}
    tied = {n: k for n, k in tied_names(step, strip).items() if n not in members}
    assert not set(tied) & {gmeta.get_fqn(p) for p in placeholders if gmeta.get_role(p) == "param"}, tied

    placeholders = list(graph.find_nodes(op="placeholder"))
    trainable = [gmeta.get_fqn(p) for p in placeholders if gmeta.get_role(p) == "param" and gmeta.get_fqn(p) in grad_of]
    frozen = [gmeta.get_fqn(p) for p in placeholders if gmeta.get_role(p) == "param" and gmeta.get_fqn(p) not in grad_of]
    ranked = order_placeholders(graph, set(frozen))
    by_fqn = {gmeta.get_fqn(p): p for p in placeholders}
    summed = sum_cast_gradients_in_low_precision(gm, {by_fqn[f]: grad_of[f] for f in trainable})
    grad_of.update({gmeta.get_fqn(p): g for p, g in summed.items()})  # a parameter used twice, autocast
    new_outs = mutated + [loss_node] + [grad_of[f] for f in trainable]
    out_node.args = (tuple(new_outs),)
    gmeta.set_output_roles(
        out_node, [f"buffer:{f}" for f in mutated_fqns] + ["loss"] + [f"grad:{f}" for f in trainable]
    )
    fold_contiguous_as_strided(gm)  # as_strided ops that are reshapes (Swin's pooler): shardable as views
    fold_batch_arange_index(gm)  # HF masks' m[arange(B), kv]: row b from row b, the batch split kept
    reorder_batch_inner_merges(gm)  # nn.MultiheadAttention(batch_first=True)'s [T*B, D] rows: batch outer
    graph.eliminate_dead_code()
    if stacked:
        fold_stack_of_unbind(gm)
    graph.lint()
    gm.recompile()
    return CapturedGraph(
        gm=gm,
        param_fqns=trainable,
        frozen_param_fqns=frozen,
        buffer_fqns=[gmeta.get_fqn(p) for p in ranked if gmeta.get_role(p) == "buffer"],
        num_batch_inputs=len(batch),
        mutated_buffer_fqns=mutated_fqns,
        loss_output_index=len(mutated),
        grad_output_index={f: len(mutated) + 1 + i for i, f in enumerate(trainable)},
        batch_size=batch[0].shape[0],
        model_name=name,
        tied=tied,
        stacked=stacked,
        notes=list(experts.notes),
    )


def set_input_roles(graph: torch.fx.Graph, sig: Any, strip: int) -> None:
    """Mark each placeholder of an aot-exported graph ``param``/``buffer`` (with its fqn, the first ``strip``
    characters of aot's name dropped: the wrapper module's prefix) or ``batch``."""
    for ph in graph.find_nodes(op="placeholder"):
        if ph.name in sig.inputs_to_parameters:
            gmeta.set_role(ph, "param", sig.inputs_to_parameters[ph.name][strip:])
        elif ph.name in sig.inputs_to_buffers:
            gmeta.set_role(ph, "buffer", sig.inputs_to_buffers[ph.name][strip:])
        else:
            gmeta.set_role(ph, "batch")


def order_placeholders(graph: torch.fx.Graph, frozen: set[str]) -> list[torch.fx.Node]:
    """Reorder the placeholders as the graph contract says: trainable params, frozen params (fqns in
    ``frozen``), buffers, batch, each in aot's order; returns them in that order."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    order = {"param": 0, "buffer": 2, "batch": 3}
    position = {p: i for i, p in enumerate(placeholders)}
    ranked = sorted(placeholders,
                    key=lambda p: (order[gmeta.get_role(p)] + (gmeta.get_fqn(p) in frozen), position[p]))
    if ranked != placeholders:
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        for p in ranked:
            anchor.prepend(p)
    return ranked
