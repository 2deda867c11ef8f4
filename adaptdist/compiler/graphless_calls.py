"""Refuse a call of an adaptdist-compiled model that ran no adaptdist graph, on several ranks.

Dynamo may run a whole call eagerly without ever calling the backend: it skips frames it cannot trace
(``nn.RNN``/``GRU``/``LSTM`` unless ``torch._dynamo.config.allow_rnn``; a graph break inside
``nn.Sequential``'s loop, e.g. BatchNorm with ``momentum=None``; a frame past the recompile limit). The
per-graph checks of :mod:`.dynamo_backend` never see such a call, and on several ranks it trains each rank's
own model: the parameters' gradients are never reduced, silently.

Three checks close that gap: :func:`refuse_eager_module_call`, a forward pre-hook of every module (installed
by :func:`guard_eager_module_calls` at the first frame compile of a job of several ranks), at the eager call
itself of a module that owns trainable parameters (or BatchNorm running statistics) inside a call compiled with
an adaptdist backend; :func:`refuse_skipped_rnn_frame`, at the end of a frame compile Dynamo gives up on
(RNNs); :func:`adaptdist.runtime.eager_parameters.refuse_eager_trained_parameters`, at a compiled step's first
backward: a parameter of the compiled module with a gradient that no adaptdist graph took as an input was used
eagerly. (A per-call check through a backend's ``backend_ctx_ctor`` is not possible: ``torch.compile`` wraps
the backend in ``_TorchCompileWrapper``, which Dynamo asks for that attribute. Per-module hooks would change
what Dynamo compiles: it compiles a torch.nn module's ``forward`` as a frame of its own when the module has
hooks; a global hook does not.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as compat
from ..errors import CaptureError


def refuse_skipped_rnn_frame(_args: Any = None) -> None:
    """Dynamo frame-compile end callback: Dynamo gives up on a frame that calls ``nn.RNN``/``GRU``/``LSTM``
    (unless ``torch._dynamo.config.allow_rnn``) and runs the whole frame eagerly, so no adaptdist graph ever
    sees its parameters; on several ranks, stop.

    Raises:
        CaptureError: says why and what to do.
    """
    error = sys.exc_info()[1]
    if error is None or "Attempted to wrap RNN" not in str(error):
        return
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    compat.raise_at_frame_compile_end(CaptureError(
        "torch.compile runs a frame that calls nn.RNN/GRU/LSTM eagerly, without any adaptdist graph (Dynamo: "
        f"{str(error).splitlines()[0]}): on {dist.get_world_size()} ranks the gradients of its parameters would "
        "never be reduced across ranks (each rank would train its own model), so adaptdist stops. Train it with "
        "`adaptdist train`, which captures RNNs, or with DistributedDataParallel (with "
        "torch._dynamo.config.allow_rnn = True Dynamo traces the RNN, but the backend's all-ranks capture, "
        "torch.vmap, has no batching rule for its fused op)"))


# torch.nn's modules that update running statistics from the batch in training mode (track_running_stats)
_RUNNING_STATS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                  nn.InstanceNorm3d)


def guard_eager_module_calls(_args: Any = None) -> None:
    """Dynamo frame-compile start callback: in a job of several ranks, install :func:`refuse_eager_module_call`
    as a forward pre-hook of every module, once per process (before Dynamo traces the first frame, so no
    compiled frame was traced without it: a global hook changes Dynamo's guards). It stays installed, as
    Dynamo's callbacks do; it is found by identity, not kept anywhere."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        compat.install_global_forward_pre_hook(refuse_eager_module_call, (_world_size, _eager_call_message))


def refuse_eager_module_call(module: nn.Module, _args: Any) -> None:
    """Forward pre-hook of every module (see :func:`guard_eager_module_calls`): a module that owns parameters
    which will receive gradients (or a training-mode BatchNorm, whose running statistics it updates from this
    rank's rows), called eagerly inside a call compiled by an adaptdist backend on several ranks, whose ``forward``
    Dynamo runs as it is (torch.nn's modules: a user module's ``forward`` is compiled as a frame of its own), is
    trained by no adaptdist graph: its gradients would never be reduced. Dynamo runs such calls eagerly after a graph
    break it cannot resume from, e.g. in torch.nn code (``nn.Sequential``'s loop over a BatchNorm with
    ``momentum=None``, which reads ``float(self.num_batches_tracked)``), and past its recompile limit, where it runs
    the frame and every module it calls uncompiled (then any module with trainable parameters is refused). Costs ~2.6 µs per module call in the
    process, mostly torch's slow path of ``Module.__call__`` under any global hook (benchmarks/RESULTS.md).

    Raises:
        CaptureError: names the module (qualified name in the compiled model, class), why and what to try.
    """
    if torch.compiler.is_compiling():  # traced (inlined) into a graph: nothing to check, and no graph break
        return
    backend = compat.dynamo_active_backend()
    run_only = False
    if backend is None:  # past the recompile limit Dynamo runs the frame and its callees uncompiled
        backend = compat.dynamo_run_only_backend()
        run_only = backend is not None
    if backend is None or not getattr(backend, "refuses_eager_module_calls", False):
        return
    trains = False
    if torch.is_grad_enabled():
        for p in module.parameters(recurse=False):  # a loop, not any(<genexpr>): Dynamo would compile that frame
            trains = trains or p.requires_grad
    updates_statistics = module.training and isinstance(module, _RUNNING_STATS) and module.track_running_stats
    if (trains or updates_statistics) and _world_size() > 1 and (run_only or compat.dynamo_runs_forward_eagerly(module)):
        raise CaptureError(_eager_call_message(module, trains, run_only))


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _eager_call_message(module: nn.Module, trains: bool, run_only: bool = False) -> str:
    """The refusal of :func:`refuse_eager_module_call`: the module, why Dynamo ran it eagerly, what to try
    (``run_only``: the enclosing frame is past Dynamo's recompile limit)."""
    wrapper = compat.dynamo_compiled_wrapper()
    root = getattr(wrapper, "_orig_mod", None)
    names = {id(m): n for n, m in root.named_modules()} if isinstance(root, nn.Module) else {}
    name = names.get(id(module))
    what = (f"module {name or '(the compiled module)'!r} ({type(module).__name__})" if name is not None
            else f"a {type(module).__name__} module")
    cumulative = [n or "(the compiled module)" for n, m in (root.named_modules() if isinstance(root, nn.Module) else ())
                  if isinstance(m, _RUNNING_STATS) and m.momentum is None and m.training]
    if run_only:
        cause = (f"Dynamo compiled the frame that calls it {compat.dynamo_recompile_limit()} times "
                 "(torch._dynamo.config.recompile_limit: its guards failed at each new call, e.g. a new input shape "
                 "under dynamic=False; TORCH_LOGS=recompiles says why) and now runs that frame, and everything it "
                 "calls, without compiling")
        fix = ("keep the input shapes fixed (e.g. drop_last=True, padding to one length) or let them be dynamic "
               "(torch.compile(dynamic=None), torch._dynamo.mark_dynamic), or raise "
               "torch._dynamo.config.recompile_limit")
    elif cumulative:
        cause = (f"BatchNorm {', '.join(map(repr, cumulative[:3]))} has momentum=None: its forward reads "
                 "float(self.num_batches_tracked), a graph break inside torch.nn code, so Dynamo runs that module call "
                 "eagerly (and, inside an nn.Sequential, the whole Sequential)")
        fix = "give the BatchNorm a numeric momentum (momentum=0.1, torch's default)"
    else:
        cause = "a graph break Dynamo could not resume from, or a frame it skips"
        fix = "remove the graph break (TORCH_LOGS=graph_breaks shows it)"
    state = ("its parameters' gradients would never be reduced across ranks" if trains else
             "its running statistics would come from each rank's own rows, never combined across ranks")
    return (f"torch.compile ran {what} eagerly, outside every adaptdist graph: {cause}. On "
            f"{dist.get_world_size()} ranks {state} (each rank would train its own model), so adaptdist stops. "
            f"Try: {fix}; or train with `adaptdist train`, which captures the whole step; or wrap the model in "
            "DistributedDataParallel instead of the adaptdist backend")
