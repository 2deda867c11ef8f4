"""Everyday training settings applied to a model before capture: mixed precision and activation checkpointing.

Both change the model's computation, not its parameters (names, shapes and dtypes stay), so that every front
end that captures the model (``adaptdist train``, ``plan``, the re-planner of elastic jobs) sees the same
step, and checkpoints, plans and samples keep speaking the user's parameter names.

- :func:`with_precision` (``--precision bf16``): the model's forward and the loss run under
  ``torch.autocast("cpu", torch.bfloat16)``, PyTorch's AMP recipe (forward and loss under autocast, backward
  outside it): parameters and optimizer state stay float32, the casts autocast makes are ops of the captured
  graph (so its activations are bf16 and the cost model counts 2 bytes for each of their elements).
- :func:`with_activation_checkpointing` (``--activation-checkpointing``): each block of the model (every
  module of a ``nn.ModuleList`` child of the root: ``blocks`` of the built-in GPT, ``layers`` of LLaMA) keeps
  only its input for the backward and runs its forward again there, as ``torch.utils.checkpoint`` does. It is
  written as an autograd Function whose backward recomputes the block (the reentrant form of checkpointing,
  source: Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016), so the captured joint graph holds
  the recomputation itself: the block's forward activations die after the forward, the recomputed ones are
  made in the backward, and the planner's liveness-based memory estimate
  (:mod:`adaptdist.cost_models.memory`) and its compute estimate see both without knowing about checkpoints.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import UsageError
from ..lowering_options import PRECISIONS  # noqa: F401 -- re-exported: the --precision values


def with_precision(model: nn.Module, loss_fn: Callable, precision: str) -> tuple[nn.Module, Callable]:
    """``model`` (changed in place: its ``forward``) and ``loss_fn`` running under ``precision``'s autocast.

    Raises:
        UsageError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision!r}: not one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return model, loss_fn
    dtype = torch.bfloat16
    model.forward = types.MethodType(_autocast_forward(type(model).forward, dtype), model)

    def loss(out: Any, target: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(out, target)

    return model, loss


def _autocast_forward(forward: Callable, dtype: torch.dtype) -> Callable:
    def autocast_forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=dtype):
            return forward(self, *args, **kwargs)
    return autocast_forward


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks :func:`with_activation_checkpointing` checkpoints: every module of each
    ``nn.ModuleList`` child of the root (``blocks.0``, ``blocks.1``, ...)."""
    return [f"{name}.{i}" for name, child in model.named_children() if isinstance(child, nn.ModuleList)
            for i in range(len(child))]


def with_activation_checkpointing(model: nn.Module) -> nn.Module:
    """``model`` with each block's forward recomputed in the backward (module docstring); changed in place.

    A block must take and return tensors (its first output a tensor) and draw no random numbers (dropout in a
    recomputed block would draw other masks in the backward than in the forward).

    Raises:
        UsageError: the model has no ``nn.ModuleList`` of blocks, or a block holds a dropout with p > 0.
    """
    names = checkpointed_blocks(model)
    if not names:
        raise UsageError(f"--activation-checkpointing: {type(model).__name__} has no nn.ModuleList of blocks as a "
                         "child (such as the built-in GPT's `blocks` or LLaMA's `layers`); checkpoint your blocks "
                         "with torch.utils.checkpoint in the model instead")
    modules = dict(model.named_modules())
    for name in names:
        block = modules[name]
        drop = [n for n, m in block.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
        if drop:
            raise UsageError(f"--activation-checkpointing: block {name} holds dropout {name}.{drop[0]} (p > 0), "
                             "which recomputation would draw again; set its p to 0 or train without the flag")
        block.forward = types.MethodType(_recomputed_forward(type(block).forward), block)
    return model


def _recomputed_forward(forward: Callable) -> Callable:
    def recomputed_forward(self, *args):
        if not torch.is_grad_enabled():
            return forward(self, *args)
        state = list(self.named_parameters()) + list(self.named_buffers())
        return _Recompute.apply(self, forward, [n for n, _ in state], len(args), *args, *[t for _, t in state])
    return recomputed_forward


class _Recompute(torch.autograd.Function):
    """``forward(block, *args)`` keeping only ``args`` for the backward (the block's parameters and buffers are
    held anyway), which runs it again with autograd, on the same tensors, and takes the vector-Jacobian product
    of that. The block's tensors are inputs of the Function, and the recomputation reads those (a capture swaps
    the module's tensors for traced ones only while the forward runs)."""

    @staticmethod
    def forward(ctx, block: nn.Module, forward: Callable, names: list[str], num_args: int, *inputs: torch.Tensor):
        ctx.block, ctx.run, ctx.names, ctx.num_args = block, forward, names, num_args
        ctx.state = inputs[num_args:]
        ctx.save_for_backward(*inputs[:num_args])
        with torch.no_grad():
            return forward(block, *inputs[:num_args])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        from .. import _torch_compat as compat

        args = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                for x in ctx.saved_tensors]
        state = list(ctx.state)
        with torch.enable_grad(), compat.reparametrize(ctx.block, dict(zip(ctx.names, state))):
            out = ctx.run(ctx.block, *args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad
                 and g is not None]
        wrt = [a for a in args + state if isinstance(a, torch.Tensor) and a.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        return (None, None, None, None,
                *[next(got) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args + state])


def apply_training_features(model: nn.Module, loss_fn: Callable, precision: str = "fp32",
                            activation_checkpointing: bool = False) -> tuple[nn.Module, Callable]:
    """``--precision`` and ``--activation-checkpointing`` applied to a freshly built model (in place) and its loss.

    Raises:
        UsageError: see :func:`with_precision` and :func:`with_activation_checkpointing`.
    """
    if activation_checkpointing:
        with_activation_checkpointing(model)
    return with_precision(model, loss_fn, precision)
