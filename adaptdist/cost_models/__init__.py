"""Cost models: predicted step time and peak memory of each rank's lowered program.

One job per module (each formula's source is in its module's docstring):

- :mod:`.schedule`       a rank program as the models see it: node order, tensors, storages and
                         their liveness, collectives and their waits (one fake-tensor run);
- :mod:`.compute`        per-node FLOPs (torch's ``FlopCounterMode`` formulas plus CPU flash attention)
                         and bytes moved, as a roofline against the device's peaks;
- :mod:`.communication`  alpha-beta ring/tree formulas per collective, the group of a collective
                         (``adaptdist:<axis>`` -> ranks) and the link tier / calibrated fit it runs at;
- :mod:`.overlap`        the two-stream timeline: what communication hides behind computation, idle time;
- :mod:`.memory`         peak live tensor bytes (``runtime/memory.py``'s metric) by liveness analysis,
                         with parameters, gradients, optimizer state (SGD, momentum, Adam/AdamW) and activations;
- :mod:`.estimate`       all of it for every rank of ``compile_model``'s output (:func:`estimate_programs`);
- :mod:`.symbolic`       the same costs as sympy expressions in batch size, sequence length and mesh-axis sizes;
- :mod:`.hardware`       the cluster interface the models read (a Protocol) and a plain-number cluster;
- :mod:`.numbers`        arithmetic shared by concrete and symbolic costs.

Units are in names: ``_s``, ``_bytes``, ``_bytes_per_s``, FLOPs as plain counts.
"""

from .estimate import RankEstimate, StepEstimate, estimate_programs, estimate_schedules
from .hardware import ClusterLike, FixedCluster, as_cost_cluster
from .memory import MemoryEstimate, estimate_memory, optimizer_model
from .schedule import StepSchedule, build_schedule
from .symbolic import SymbolicEstimate, fit_symbolic_estimate

__all__ = [
    "ClusterLike", "FixedCluster", "MemoryEstimate", "RankEstimate", "StepEstimate", "StepSchedule",
    "SymbolicEstimate", "as_cost_cluster", "build_schedule", "estimate_memory", "estimate_programs",
    "estimate_schedules", "fit_symbolic_estimate", "optimizer_model",
]
