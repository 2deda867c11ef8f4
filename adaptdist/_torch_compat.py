"""The one place adaptdist touches torch's private APIs.

A torch upgrade that moves one of these should break this file only.
Checked against torch 2.13.0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx


def aot_export_joint(module: torch.nn.Module, args: tuple, loss_index: int = 0):
    """Export ``module(*args)`` and its backward as one functional ATen graph.

    Returns ``(GraphModule, GraphSignature)``; the signature lists parameters,
    buffers, user inputs, buffer mutations, the loss output and which output is
    which parameter's gradient. Source: ``torch._functorch.aot_autograd.aot_export_module``.
    """
    from torch._functorch.aot_autograd import aot_export_module

    return aot_export_module(module, args, trace_joint=True, output_loss_index=loss_index)


def fake_tensor_mode(allow_constants: bool = False) -> Any:
    """A fresh FakeTensorMode (shapes and dtypes only, no storage).

    ``allow_constants``: real tensors the traced code closes over (a loss's class
    weights, say) are accepted and become constants of the graph.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_constants)


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def reparametrize(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: temporarily swap the module's parameters/buffers by name."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True)


def fx_code_globals() -> dict[str, Any]:
    """The names FX-generated code refers to (``torch``, ``device``, ``inf``, ...)."""
    from torch.fx.graph import _custom_builtins

    return {name: b.obj for name, b in _custom_builtins.items()}


def register_process_group(name: str, group: Any) -> None:
    """Make ``group`` resolvable by ``name`` in functional collectives (``_c10d_functional.*``);
    a name registered before (an earlier program's mesh) is re-pointed."""
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # not registered yet
        pass
    torch._C._distributed_c10d._register_process_group(name, group)


def unregister_all_process_groups() -> None:
    torch._C._distributed_c10d._unregister_all_process_groups()


def functional_all_reduce_op() -> Callable:
    return torch.ops._c10d_functional.all_reduce.default


def functional_all_gather_op() -> Callable:
    """``all_gather_into_tensor(x, group_size, group_name)``: concatenates equal-sized shards on dim 0."""
    return torch.ops._c10d_functional.all_gather_into_tensor.default


def functional_reduce_scatter_op() -> Callable:
    """``reduce_scatter_tensor(x, op, group_size, group_name)``: sums over ranks, rank r keeps block r of dim 0."""
    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def functional_wait_op() -> Callable:
    return torch.ops._c10d_functional.wait_tensor.default


@contextlib.contextmanager
def no_dispatch():
    from torch.utils._mode_utils import no_dispatch as _nd

    with _nd():
        yield


def torch_dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every ATen op a region runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def trace_fake(fn: Callable, specs: list[tuple[list[int], torch.dtype]]) -> torch.fx.GraphModule:
    """Trace ``fn`` to an ATen GraphModule on CPU fake tensors of the given (shape, dtype) (no real compute)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = fake_tensor_mode()
    with mode:
        inputs = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def flop_formula_registry() -> dict[Any, Callable]:
    """A copy of ``torch.utils.flop_counter.flop_registry``: op overload packet -> FLOP formula.

    Each formula is called as ``formula(*args, out_val=out, **kwargs)`` with tensors or shapes
    in place of tensors (torch's ``shape_wrapper`` maps tensors to their shapes and leaves shapes as
    they are) and returns FLOPs. Used as is by ``FlopCounterMode``.
    """
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


def flop_shape_wrapper(formula: Callable) -> Callable:
    """``torch.utils.flop_counter.shape_wrapper``: lets a formula written on shapes take tensors too."""
    from torch.utils.flop_counter import shape_wrapper

    return shape_wrapper(formula)


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage (its StorageImpl), shared by all views of it; valid while ``t`` lives."""
    return t.untyped_storage()._cdata
