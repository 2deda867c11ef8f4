"""Parameters trained by eager code that no adaptdist graph saw (the backend; see
:mod:`adaptdist.compiler.graphless_calls` for the cases Dynamo runs eagerly)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from .. import _torch_compat as compat
from ..errors import CaptureError


@dataclass
class GraphRuns:
    """What one backend's compiled graphs have seen: how many graph calls ran, and the parameters (by id) any
    of them took as inputs."""

    count: int = 0
    param_ids: set[int] = field(default_factory=set)


def refuse_eager_trained_parameters(root: nn.Module | None, runs: GraphRuns) -> None:
    """At a compiled step's first backward, on several ranks: refuse parameters of the compiled module that
    received a gradient but were never an input of any adaptdist graph, i.e. were used by code Dynamo ran
    eagerly after the graphs (a graph break inside ``nn.Sequential``'s loop runs the rest of the loop eagerly;
    autograd reaches those parameters before the graph's backward). Earlier eager code is refused at the
    graph's input (``compiled_step._refuse_eager_parameters``).

    Raises:
        CaptureError: names the parameters, their shapes and what to try.
    """
    if root is None or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    eager = [(n, p) for n, p in root.named_parameters()
             if p.requires_grad and p.grad is not None and id(p) not in runs.param_ids]
    if not eager:
        return
    names = ", ".join(f"{n} {list(p.shape)}" for n, p in eager[:4]) + (" ..." if len(eager) > 4 else "")
    breaks = "; ".join(f"{site} ({reason.splitlines()[0]})" for site, reason in compat.graph_break_sites())
    raise CaptureError(
        f"{len(eager)} parameter(s) of the compiled model ({names}) received gradients from code Dynamo ran eagerly, "
        f"outside every adaptdist graph: on {dist.get_world_size()} ranks their gradients would never be reduced "
        f"across ranks (each rank would train its own copy), so adaptdist stops. Graph breaks so far: "
        f"{breaks or 'none recorded'}. A break inside nn.Sequential's loop runs the rest of it eagerly (BatchNorm "
        "with momentum=None reads float(num_batches_tracked)): give it a numeric momentum, or remove the break "
        "(TORCH_LOGS=graph_breaks shows it), or train with `adaptdist train`")
