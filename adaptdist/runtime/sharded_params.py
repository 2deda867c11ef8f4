"""Parameters that hold only this rank's shard, under torch.compile.

After the first compiled call, a parameter the plan shards holds this rank's shard as its data, so the
optimizer (built before or after ``torch.compile``) keeps sharded state. The user's code and Dynamo still
see the parameter's full shape where it matters:

- while the compiled module runs, a forward pre-hook on the module swaps each sharded parameter's data
  for a *placeholder*: a full-shaped view of one element (stride 0, no memory), and a forward hook swaps
  the shard back. When Dynamo re-traces the forward (``no_grad()`` for evaluation, a new input shape), it
  traces the user's code on the full shapes, as the first time;
- Dynamo's guards on those parameters' sizes are dropped at compile time
  (:func:`adaptdist._torch_compat.drop_tensor_guards`), so the swaps alone never trigger a re-trace;
- the compiled program reads the shard from :attr:`ShardLayout.shard`, and its gradient is accumulated
  into ``param.grad`` directly (the shard's shape; autograd would expect the placeholder's).

Between forward calls (``backward()``, ``opt.step()``, ``state_dict()``) the parameters are their shards
(``state_dict()`` warns so; ``load_state_dict`` of full tensors keeps each rank's shard of them). Calling
the original module directly, not through ``torch.compile``, raises: it would compute with placeholders.
This is what FSDP2 does with DTensor parameters and all_gathers in its hooks; here the placeholder needs no
communication, because the compiled program does the gathering the plan chose. The forward hook runs also
when the forward raises. A torch.nn module itself (``nn.Sequential``, ...) is compiled by Dynamo in a frame
that traces the module's own hooks, so its swaps are hooks of its ``torch.compile`` wrapper instead (they run
before that frame), and the module keeps only a pre-hook refusing direct calls. A compiled plain function (not a module) gets no hooks: its parameters are still
sharded, but a re-trace would see their shards' shapes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from .. import _torch_compat as compat
from ..errors import AdaptdistError

HOOKED = "_adaptdist_param_hooks"


def layout_of(p: torch.Tensor) -> Any:
    """The :class:`~adaptdist.runtime.compiled_step.ShardLayout` of a parameter adaptdist sharded, or None."""
    return getattr(p, "_adaptdist_layout", None)


def shard_parameter(p: nn.Parameter, layout: Any, rank: int) -> None:
    """Make ``p`` hold rank ``rank``'s shard of its full data (once; a no-op if it is sharded already)."""
    if layout_of(p) is not None:
        return
    with torch.no_grad():
        layout.shard = layout.local(p.data, rank)
        p.data = layout.shard
    p._adaptdist_layout = layout


def placeholder(layout: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A full-shaped tensor of one element (every stride 0): what Dynamo traces in a shard's place."""
    return torch.zeros((), dtype=dtype, device=device).expand(layout.global_shape)


class ShardedStateWarning(UserWarning):
    """A state dict of a model whose parameters adaptdist sharded holds this rank's shards."""


def _sharded(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if layout_of(p) is not None]


def _direct_call_error(module: nn.Module, sharded: list[tuple[str, nn.Parameter]]) -> AdaptdistError:
    name, p = sharded[0]
    return AdaptdistError(
        f"{type(module).__name__} was called directly, but adaptdist sharded its parameters ({name} holds "
        f"this rank's shard {list(p.shape)} of {list(layout_of(p).global_shape)}, and {len(sharded) - 1} more): "
        "call the torch.compile'd model, or load adaptdist.full_state_dict(compiled) into an uncompiled copy")


def _refuse_direct_call(module: nn.Module, args: Any) -> None:
    """The pre-hook of a module whose placeholder swaps run on its torch.compile wrapper: Dynamo traces it
    (as nothing: no graph break), and an eager call of the module itself raises."""
    if torch.compiler.is_compiling() or compat.in_compiled_module_call():
        return
    sharded = _sharded(module)
    if sharded:
        raise _direct_call_error(module, sharded)


@torch.compiler.disable
def _to_placeholders(module: nn.Module, args: Any) -> None:
    sharded = _sharded(module)
    if not sharded:
        return
    if not compat.in_compiled_module_call():
        raise _direct_call_error(module, sharded)
    for _, p in sharded:
        layout = layout_of(p)
        if p.data.data_ptr() == layout.shard.data_ptr():
            # the gradient goes aside too: Dynamo copies it onto its fake of the full-shaped placeholder
            layout.grad, p.grad = p.grad, None
            p.data = placeholder(layout, p.dtype, p.device)


@torch.compiler.disable
def _to_shards(module: nn.Module, args: Any, output: Any) -> None:
    for _, p in _sharded(module):
        layout = layout_of(p)
        p.data = layout.shard
        if layout.grad is not None:
            p.grad, layout.grad = layout.grad, None


def _warn_sharded_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    if _sharded(module):
        warnings.warn("this state dict holds each sharded parameter's shard on this rank, not the full tensor; "
                      "adaptdist.full_state_dict(model) returns the full one (load_state_dict takes either)",
                      ShardedStateWarning, stacklevel=3)


def _shard_loaded_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` of full tensors into a sharded model: each rank keeps its own shard of them."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for name, p in _sharded(module):
        key = prefix + name
        full = state_dict.get(key)
        layout = layout_of(p)
        if isinstance(full, torch.Tensor) and tuple(full.shape) == tuple(layout.global_shape):
            state_dict[key] = layout.local(full, rank)


def install_hooks(module: nn.Module, wrapper: nn.Module | None = None) -> None:
    """Register on ``module``, once: the placeholder swaps around its forward (module docstring), the warning
    on ``state_dict()`` that it holds shards, and the sharding of full tensors given to ``load_state_dict``.

    With ``wrapper`` (the ``torch.compile`` wrapper of a torch.nn module such as ``nn.Sequential``, whose
    hooks Dynamo traces inside the compiled frame instead of running them before it) the swaps go on the
    wrapper, whose hooks run before the frame, and ``module`` gets a pre-hook that refuses direct calls."""
    if getattr(module, HOOKED, False):
        return
    if wrapper is None:
        module.register_forward_pre_hook(_to_placeholders)
        module.register_forward_hook(_to_shards, always_call=True)
    else:
        wrapper.register_forward_pre_hook(_to_placeholders)
        wrapper.register_forward_hook(_to_shards, always_call=True)
        module.register_forward_pre_hook(_refuse_direct_call)
    module.register_state_dict_post_hook(_warn_sharded_state)
    module.register_load_state_dict_pre_hook(_shard_loaded_state)
    setattr(module, HOOKED, True)


def accumulate_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``p.grad += grad`` (or ``= grad``), as autograd's AccumulateGrad does for a leaf."""
    grad = grad.detach()
    if p.grad is None:
        p.grad = grad
    else:
        p.grad = p.grad + grad


def clip_grad_norm_(parameters: Any, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model the backend sharded: the 2-norm of the whole model's
    gradient, from every rank's shards, and every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``
    (torch's rule). A collective when some parameter is sharded: every rank must call it. torch's own
    function would take the norm of this rank's shards only.

    Args:
        parameters: a module or an iterable of parameters (e.g. ``model.parameters()``).
        max_norm: the largest allowed norm (> 0).

    Returns:
        The norm before clipping (float64 scalar tensor), the same on every rank.

    Raises:
        ValueError: ``max_norm`` is not positive.
    """
    import torch.distributed as dist

    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    with_grad = [p for p in params if p.grad is not None]
    whole = torch.zeros((), dtype=torch.float64)
    shards = torch.zeros((), dtype=torch.float64)
    sharded = False
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for p in with_grad:
        sq = p.grad.detach().double().pow(2).sum()
        layout = layout_of(p)
        if layout is None:
            whole = whole + sq  # the same on every rank: counted once
        else:
            sharded = True
            copies = sum(r == layout.ranges[rank] for r in layout.ranges)  # ranks holding this very shard
            shards = shards + sq / copies
    if sharded and dist.is_available() and dist.is_initialized():
        dist.all_reduce(shards)
    norm = (whole + shards).sqrt()
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for p in with_grad:
            p.grad.mul_(coef)
    return norm
