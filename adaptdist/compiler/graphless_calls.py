"""Refuse a call of an adaptdist-compiled model that ran no adaptdist graph, on several ranks.

Dynamo may run a whole call eagerly without ever calling the backend: it skips frames it cannot trace
(``nn.RNN``/``GRU``/``LSTM`` unless ``torch._dynamo.config.allow_rnn``; a graph break inside
``nn.Sequential``'s loop, e.g. BatchNorm with ``momentum=None``; a frame past the recompile limit). The
per-graph checks of :mod:`.dynamo_backend` never see such a call, and on several ranks it trains each rank's
own model: the parameters' gradients are never reduced, silently.

Two checks close that gap: :func:`refuse_skipped_rnn_frame`, at the end of a frame compile Dynamo gives up
on (RNNs); :func:`adaptdist.runtime.eager_parameters.refuse_eager_trained_parameters`, at a compiled step's
first backward: a parameter of the compiled module with a gradient that no adaptdist graph took as an input
was used eagerly. (A per-call
check through a backend's ``backend_ctx_ctor`` is not possible: ``torch.compile`` wraps the backend in
``_TorchCompileWrapper``, which Dynamo asks for that attribute.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

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
        "`adaptdist train`, which captures RNNs, or set torch._dynamo.config.allow_rnn = True before torch.compile"))
