"""adaptdist: an end-to-end adaptive distributed training compiler for PyTorch.

``adaptdist.backend(...)`` configures the torch.compile backend (``backend="adaptdist"`` needs no
import); ``adaptdist.full_state_dict(model)`` returns the unsharded state dict of a model it compiled.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing adaptdist (the CLI, spawned ranks) does not import torch.
    if name == "backend":
        from .compiler.dynamo_backend import backend

        return backend
    if name == "full_state_dict":
        from .runtime.compiled_step import full_state_dict

        return full_state_dict
    raise AttributeError(f"module 'adaptdist' has no attribute {name!r}")
