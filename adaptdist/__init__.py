"""adaptdist: an end-to-end adaptive distributed training compiler for PyTorch.

``adaptdist.backend(...)`` configures the torch.compile backend (``backend="adaptdist"`` needs no
import; ``adaptdist.AdaptdistBackend`` is its class, ``adaptdist.ManualPlan`` a manual plan);
``adaptdist.full_state_dict(model)`` returns the unsharded state dict of a model it compiled, and
``adaptdist.clip_grad_norm_(model, max_norm)`` clips by the norm of its whole (sharded) gradient;
``adaptdist.save_checkpoint(path, model, optimizer, step=...)`` and ``adaptdist.load_checkpoint(path, model,
optimizer)`` checkpoint and resume it under any plan and world size. ``adaptdist.kernels`` loads the
C++ kernels (``torch.ops.adaptdist.*``: shared-memory collectives, :mod:`adaptdist.kernels.shm`).
"""

from ._version import __version__
from .kernels import load_if_torch_imported as _load_kernels_if_torch_imported

# The C++ kernels (torch.ops.adaptdist.*) register on import when torch is loaded already; otherwise the
# first adaptdist module that imports torch loads them (adaptdist/kernels/__init__.py). Never raises.
_load_kernels_if_torch_imported()


def __getattr__(name: str):
    # Lazy: importing adaptdist (the CLI, spawned ranks) does not import torch.
    if name == "backend":
        from .compiler.dynamo_backend import backend

        return backend
    if name == "AdaptdistBackend":
        from .compiler.dynamo_backend import AdaptdistBackend

        return AdaptdistBackend
    if name == "ManualPlan":
        from .annotations import ManualPlan

        return ManualPlan
    if name == "clip_grad_norm_":
        from .runtime.sharded_params import clip_grad_norm_

        return clip_grad_norm_
    if name in ("save_checkpoint", "load_checkpoint"):
        from .runtime import backend_checkpoint

        return getattr(backend_checkpoint, name)
    if name == "full_state_dict":
        from .runtime.compiled_step import full_state_dict

        return full_state_dict
    raise AttributeError(f"module 'adaptdist' has no attribute {name!r}")


def __dir__():
    return ["AdaptdistBackend", "ManualPlan", "__version__", "backend", "clip_grad_norm_", "full_state_dict", "load_checkpoint",
            "save_checkpoint"]
