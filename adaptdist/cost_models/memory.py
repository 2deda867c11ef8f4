"""Peak memory of one rank's training step, by liveness analysis over its schedule.

The metric is :mod:`adaptdist.runtime.memory`'s: the peak, over one step, of the bytes of
live tensor storages (each storage once however many views share it). A step is the rank
program followed by the optimizer's step, as ``runtime.worker.StepRunner.step`` runs it.

Live storages at node ``i`` of the program (the program's node order is its schedule):
every storage created at or before ``i`` whose last use (the last node reading it or any
view of it) is at or after ``i`` — FX-generated code drops each value right after its last
user, and an unused value right after it is made. Parameters, buffers and the batch are
live throughout (the caller holds them); the program's outputs (loss, gradients) stay live
through the optimizer step. The optimizer's state is live throughout:

    peak = max( max_i live(i) + state,  live(end) + state + optimizer temporaries )

Optimizer state and temporaries, read off torch 2.13's single-tensor implementations
(``torch/optim/sgd.py`` ``_single_tensor_sgd``, ``torch/optim/adam.py``
``_single_tensor_adam``; CPU tensors take these paths), with ``s_i`` the bytes of parameter
``i`` in the optimizer's order:

    ============  ========================================  ==========================================
    optimizer     state                                      temporaries (peak during step())
    ============  ========================================  ==========================================
    sgd           0                                          0 (``param.add_(grad)``)
    sgd_momentum  sum s_i (``momentum_buffer``)              0 (``buf.mul_().add_()``, in place)
    adam, adamw   2 sum s_i (``exp_avg``, ``exp_avg_sq``)    max_i (2 s_i + s_{i-1}): ``denom =
                  + 4 B per parameter (float32 ``step``)     (exp_avg_sq.sqrt() / c).add_(eps)`` makes
                                                             two tensors while the previous ``denom``
                                                             is still referenced
    ============  ========================================  ==========================================

Every function works on concrete schedules (ints) and symbolic ones (sympy expressions):
the symbolic peak is a ``Max`` over the live sets that are not contained in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import UsageError
from .numbers import is_symbolic, prune_dominated, smax
from .schedule import StepSchedule

OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")

_PARAM_OWNERS = ("param", "buffer")


@dataclass(frozen=True)
class OptimizerModel:
    """Memory and traffic of one optimizer (table in the module docstring).

    Attributes:
        name: one of :data:`OPTIMIZERS`.
        state_copies: optimizer-state tensors per parameter, each the parameter's size.
        scalar_state_bytes: bytes of per-parameter scalar state (Adam's float32 ``step``).
        bytes_per_param_byte: memory traffic of one ``step()`` per parameter byte (reads and writes of
            every in-place/elementwise op in the single-tensor implementation), for its roofline time.
        ops_per_param: ATen ops one ``step()`` dispatches per parameter tensor in the single-tensor
            implementation, each costing the device's ``op_overhead_s`` (see :func:`optimizer_model`).
    """

    name: str
    state_copies: int
    scalar_state_bytes: int
    bytes_per_param_byte: int
    ops_per_param: int = 0

    def state_bytes(self, param_bytes: Sequence[Any]) -> Any:
        """Bytes of optimizer state for parameters of ``param_bytes`` bytes each."""
        total: Any = 0
        for s in param_bytes:
            total = total + self.state_copies * s + self.scalar_state_bytes
        return total

    def temporary_bytes(self, param_bytes: Sequence[Any]) -> Any:
        """Peak bytes of the tensors ``step()`` makes and frees (module docstring)."""
        if self.name not in ("adam", "adamw") or not param_bytes:
            return 0
        prev: Any = 0
        terms = []
        for s in param_bytes:
            terms.append(2 * s + prev)
            prev = s
        return smax(*terms)


def optimizer_model(name: str) -> OptimizerModel:
    """The :class:`OptimizerModel` of ``name`` (``sgd``, ``sgd_momentum``, ``adam``, ``adamw``).

    Traffic per parameter byte: sgd 3 (read p, g; write p); sgd_momentum 8 (``buf.mul_`` 2,
    ``buf.add_`` 3, ``p.add_`` 3); adam/adamw 18 (``lerp_`` 3, ``mul_`` 2, ``addcmul_`` 3, ``sqrt`` 2,
    ``div`` 2, ``add_`` 2, ``addcdiv_`` 4).

    Ops per parameter tensor (torch 2.13 ``_single_tensor_sgd`` / ``_single_tensor_adam``, weight decay
    0, no amsgrad): sgd 1 (``param.add_``); sgd_momentum 3 (``buf.mul_().add_()``, ``param.add_``);
    adam/adamw 9 (``step_t += 1``, ``exp_avg.lerp_``, ``exp_avg_sq.mul_().addcmul_()``, ``step_t.item()``
    through ``_get_value``, ``sqrt``, ``div``, ``add_``, ``param.addcdiv_``).

    Raises:
        UsageError: an unknown optimizer.
    """
    table = {
        "sgd": OptimizerModel("sgd", 0, 0, 3, 1),
        "sgd_momentum": OptimizerModel("sgd_momentum", 1, 0, 8, 3),
        "adam": OptimizerModel("adam", 2, 4, 18, 9),
        "adamw": OptimizerModel("adamw", 2, 4, 18, 9),
    }
    key = name.replace("-", "_").lower()
    if key not in table:
        raise UsageError(f"no memory model for optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    return table[key]


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak live tensor bytes of one rank's step, and what is live at the peak.

    Attributes:
        peak_bytes: the peak (the metric of :mod:`adaptdist.runtime.memory`).
        params_bytes: parameters and buffers this rank holds.
        grads_bytes: gradient storages live at the peak.
        optimizer_state_bytes: optimizer state (live throughout).
        optimizer_temp_bytes: optimizer temporaries live at the peak (0 unless the peak is in ``step()``).
        activations_bytes: everything else live at the peak: activations, temporaries, communication
            buffers, the batch, the loss.
        peak_at: the node at which the peak occurs, or ``"optimizer.step"``.
    """

    peak_bytes: Any
    params_bytes: Any
    grads_bytes: Any
    optimizer_state_bytes: Any
    optimizer_temp_bytes: Any
    activations_bytes: Any
    peak_at: str


def live_storages(schedule: StepSchedule, i: int) -> list[int]:
    """Indices of the storages live while node ``i`` runs (``i = len(nodes)``: after the program returns)."""
    return [k for k, s in enumerate(schedule.storages) if s.created <= i <= s.last_use]


def _sum(schedule: StepSchedule, ks: Sequence[int], owners: Sequence[str] | None = None) -> Any:
    total: Any = 0
    for k in ks:
        s = schedule.storages[k]
        if owners is None or s.owner in owners:
            total = total + s.nbytes
    return total


def _candidate_points(schedule: StepSchedule) -> list[int]:
    """Nodes where the live set can peak: where a storage is created (between creations it only shrinks)."""
    return sorted({s.created for s in schedule.storages})


def program_peak(schedule: StepSchedule) -> tuple[Any, int]:
    """Peak live bytes over the program's nodes and the node index where it occurs (concrete schedules;
    for a symbolic one the index is the first candidate). See the module docstring."""
    points = _candidate_points(schedule)
    if not points:
        return 0, 0
    if not any(is_symbolic(s.nbytes) for s in schedule.storages):
        sizes = [int(s.nbytes) for s in schedule.storages]
        delta = [0] * (schedule.end + 2)
        for s, n in zip(schedule.storages, sizes):
            delta[s.created] += n
            delta[s.last_use + 1] -= n
        best, best_i, cur, at_points = -1, 0, 0, set(points)
        for i in range(schedule.end + 1):
            cur += delta[i]
            if i in at_points and cur > best:
                best, best_i = cur, i
        return best, best_i
    sets = [frozenset(live_storages(schedule, i)) for i in points]
    maximal = []
    for k, a in enumerate(sets):
        if any((a < b) or (a == b and j < k) for j, b in enumerate(sets)):
            continue
        maximal.append(a)
    return smax(*prune_dominated([_sum(schedule, sorted(a)) for a in maximal])), points[0]


def estimate_memory(schedule: StepSchedule, optimizer: str | OptimizerModel = "adamw") -> MemoryEstimate:
    """Peak memory of one rank's step under ``optimizer`` (module docstring), with its breakdown.

    Args:
        schedule: the rank's :class:`~.schedule.StepSchedule` (concrete or symbolic).
        optimizer: a name in :data:`OPTIMIZERS` or an :class:`OptimizerModel`.

    Returns:
        A :class:`MemoryEstimate`, bytes. For a symbolic schedule, the breakdown fields are those at the
        end of the step (parameters, all gradients) and ``activations_bytes`` is the rest of the peak.

    Raises:
        UsageError: an unknown optimizer.
    """
    opt = optimizer if isinstance(optimizer, OptimizerModel) else optimizer_model(optimizer)
    param_bytes = [schedule.storages[k].nbytes for k in schedule.param_storages]
    state = opt.state_bytes(param_bytes)
    temp = opt.temporary_bytes(param_bytes)
    prog_peak, at = program_peak(schedule)
    end_live = live_storages(schedule, schedule.end)
    step_peak = _sum(schedule, end_live) + temp
    all_params = _sum(schedule, range(len(schedule.storages)), _PARAM_OWNERS)
    symbolic = is_symbolic(prog_peak) or is_symbolic(step_peak)
    if symbolic:
        peak = smax(prog_peak + state, step_peak + state)
        grads = _sum(schedule, end_live, ("grad",))
        return MemoryEstimate(peak, all_params, grads, state, 0, peak - all_params - grads - state, "symbolic")
    if step_peak >= prog_peak:
        live, temp_at, where = end_live, temp, "optimizer.step"
    else:
        live, temp_at, where = live_storages(schedule, at), 0, schedule.nodes[at].name
    params = _sum(schedule, live, _PARAM_OWNERS)
    grads = _sum(schedule, live, ("grad",))
    total = _sum(schedule, live) + temp_at + state
    return MemoryEstimate(total, params, grads, state, temp_at, total - params - grads - state - temp_at, where)
