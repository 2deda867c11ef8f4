"""Resource-aware placement of a plan on a cluster: the rank mapping and uneven data-parallel batch rows.

:func:`place_on_devices` takes a plan (manual or the planner's) and the cluster it will run on, and returns the
plan with a :class:`~adaptdist.device_assignment.DeviceAssignment` and the programs lowered for it:

1. lower the plan with torch.chunk's split and read each mesh axis's bytes per step from rank 0's collectives;
2. map ranks to devices (:func:`~adaptdist.device_assignment.map_ranks`: the heaviest axis on the fastest links);
3. price each rank of that lowering on its own device (:func:`~adaptdist.cost_models.estimate.estimate_programs`
   on :func:`~adaptdist.device_assignment.permuted_cluster`): per rank, a fixed part (the optimizer step) and a
   per-row part (the rest of its compute over its rows), and its memory the same way (peak minus activations,
   plus activations per row);
4. give each batch-axis coordinate the rows :func:`~adaptdist.device_assignment.balanced_rows` chooses (minimizing
   the slowest rank's compute, each coordinate as slow as its slowest rank, within each device's memory) and
   lower again with them. Uniform devices keep torch.chunk's split (and their programs).

The gradient average stays the global mean over all rows whatever the split: ``passes/globalize_reductions.py``
divides sums by the global count. The torch.compile backend does not come here (it keeps DDP's even split).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from ..device_assignment import (DeviceAssignment, balanced_rows, is_uniform, map_ranks, permuted_cluster)
from ..errors import PlanInfeasibleError, UnsupportedOpError, UsageError
from ..plan import Plan

log = logging.getLogger("adaptdist.compiler")

BATCH_SPLITS = ("auto", "even")
"""``--batch-split`` values besides explicit row counts (``4,2,2``)."""


def parse_batch_split(text: str | None) -> str | tuple[int, ...]:
    """``auto`` (None), ``even`` or comma-separated row counts per batch-axis coordinate (``4,2,2``).

    Raises:
        UsageError: anything else.
    """
    if text is None or text == "auto":
        return "auto"
    if text == "even":
        return "even"
    try:
        rows = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--batch-split {text!r}: give auto, even, or rows per batch-axis coordinate like 4,2,2")
    if any(r < 0 for r in rows):
        raise UsageError(f"--batch-split {text!r}: row counts must be >= 0")
    return rows


def _axis_bytes(program: Any) -> dict[str, float]:
    from .consistency import collective_calls

    out: dict[str, float] = {}
    for c in collective_calls(program):
        axis = c.group.removeprefix("adaptdist:")
        out[axis] = out.get(axis, 0.0) + 4.0 * c.numel
    return out


def place_on_devices(captured: Any, plan: Plan, cluster: Any, options: Any, lower: Any, *,
                     state: dict | None = None,
                     optimizer: str = "adamw", batch_split: str | tuple[int, ...] = "auto",
                     timings: dict[str, float] | None = None) -> tuple[Plan, dict[int, Any]]:
    """``plan`` with its :attr:`~adaptdist.plan.Plan.devices` chosen for ``cluster``, and its programs (see the
    module docstring), lowered by ``lower`` (:func:`~.lowering.lower`, passed in: the lowering calls this
    module). ``batch_split``: ``auto`` (by speed and memory), ``even`` (torch.chunk) or explicit rows
    per batch-axis coordinate.

    Raises:
        PlanInfeasibleError: a device's memory cannot hold its share (or any share: the state alone does not
            fit); names the device (rank, host, cpus) and its memory.
        UsageError: explicit rows of the wrong count or sum; the mesh and the cluster differ in size.
        UnsupportedOpError, CollectiveMismatchError: as :func:`~.lowering.lower`.
    """
    mesh = plan.mesh_spec
    if mesh.world_size != cluster.world_size or getattr(plan, "pipeline", None) is not None:
        # a pipeline plan's stages get their devices from the stage DP (rank_capacities), not from here
        return plan, lower(captured, plan, options, state=state, timings=timings)
    base = dataclasses.replace(plan, devices=None)
    even = lower(captured, base, options, state=state, timings=timings)
    mapping, why = map_ranks(cluster, mesh, _axis_bytes(even[0]))
    rank_to_device = None if mapping == tuple(range(mesh.world_size)) else mapping
    pc = permuted_cluster(cluster, rank_to_device)
    axis = plan.batch_axis
    splits = axis is not None and mesh.size(axis) > 1 and captured.batch_size > 1
    rows: tuple[int, ...] | None = None
    reason = f"rank mapping: {why}" if rank_to_device is not None else ""
    if splits and isinstance(batch_split, tuple):
        if len(batch_split) != mesh.size(axis) or sum(batch_split) != captured.batch_size:
            raise UsageError(f"--batch-split {','.join(map(str, batch_split))}: give {mesh.size(axis)} row counts "
                             f"(one per coordinate of the batch axis {axis!r}) adding up to the batch size "
                             f"{captured.batch_size}")
        rows, reason = batch_split, _join("batch rows as given", reason)
    elif splits and batch_split == "auto" and not is_uniform(pc):
        rows = _balanced(even, pc, mesh, axis, captured.batch_size, optimizer, mapping)
        if rows == tuple(even[mesh.rank(_coords(mesh, axis, i))].batch_slice[1] for i in range(mesh.size(axis))):
            rows = None
        reason = _join("batch rows by each device's predicted speed, within its memory" if rows is not None
                       else "the even split is already the balanced one", reason)
    if rows is None and rank_to_device is None:
        return plan, even  # torch.chunk's split, rank r on device r: nothing to record
    devices = DeviceAssignment(rows, rank_to_device, reason)
    placed = dataclasses.replace(plan, devices=devices)
    if rows is None:
        return placed, {r: _with_plan(p, placed) for r, p in even.items()}
    try:
        return placed, lower(captured, placed, options, state=state, timings=timings)
    except UnsupportedOpError as e:
        if isinstance(batch_split, tuple):
            raise
        log.warning("uneven batch rows %s do not lower (%s); keeping torch.chunk's split", list(rows),
                    str(e).splitlines()[0])
        placed = dataclasses.replace(plan, devices=DeviceAssignment(None, rank_to_device, "even split: uneven rows "
                                                                    f"do not lower ({str(e).splitlines()[0]})"))
        return placed, {r: _with_plan(p, placed) for r, p in even.items()}


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _with_plan(program: Any, plan: Plan) -> Any:
    program.plan = dataclasses.replace(plan, lowered=program.plan.lowered if program.plan is not None else None)
    return program


def _coords(mesh: Any, axis: str, i: int) -> tuple[int, ...]:
    return tuple(i if a == axis else 0 for a in mesh.names)


def balanced_batch_rows(programs: dict[int, Any], cluster: Any, optimizer: str = "adamw",
                        time_scale: "Sequence[float] | None" = None, estimate: Any = None) -> tuple[int, ...] | None:
    """Rows per coordinate of the batch axis of ``programs``' plan (a data-parallel axis, any current split)
    minimizing the slowest rank's compute within each device's memory, as :func:`place_on_devices` chooses
    them, with each program rank's predicted compute seconds multiplied by ``time_scale[r]`` (None: 1): the
    in-run measured over predicted compute of that rank (:mod:`adaptdist.runtime.rebalance`). ``cluster``: the
    devices as the programs' plan maps them (:func:`~adaptdist.device_assignment.program_cluster`);
    ``estimate``: :func:`~adaptdist.cost_models.estimate.estimate_programs` of ``programs`` on it, when known.
    None when the plan has no batch axis, or a rank holds no rows (nothing to scale from).

    Raises:
        PlanInfeasibleError: as :func:`place_on_devices` (a device too small for any rows; the batch does not fit).
    """
    p0 = programs[min(programs)]
    plan = p0.plan
    axis = getattr(plan, "batch_axis", None)
    if axis is None or plan.mesh_spec.size(axis) < 2:
        return None
    bs = sum(programs[plan.mesh_spec.rank(_coords(plan.mesh_spec, axis, i))].batch_slice[1]
             for i in range(plan.mesh_spec.size(axis)))
    mapping = (plan.devices.rank_to_device if plan.devices is not None and plan.devices.rank_to_device is not None
               else tuple(range(plan.mesh_spec.world_size)))
    return _balanced(programs, cluster, plan.mesh_spec, axis, bs, optimizer, mapping, time_scale, estimate)


def _balanced(even: dict[int, Any], cluster: Any, mesh: Any, axis: str, batch_size: int, optimizer: str,
              mapping: tuple[int, ...], time_scale: "Sequence[float] | None" = None,
              est: Any = None) -> tuple[int, ...] | None:
    """Rows per batch-axis coordinate minimizing the slowest rank's predicted compute within memory (module
    docstring, step 3-4), each rank's times scaled by ``time_scale[r]``; None when a rank of the split given
    holds no rows (nothing to scale from)."""
    from ..cost_models.estimate import estimate_programs

    est = est if est is not None else estimate_programs(even, cluster, optimizer)
    k = mesh.index(axis)
    times, caps = [], []
    for i in range(mesh.size(axis)):
        members = [r for r in range(mesh.world_size) if mesh.coords(r)[k] == i]
        models = []
        cap = math.inf
        for r in members:
            e = est.ranks[r]
            n0 = even[r].batch_slice[1]
            if n0 == 0:
                return None
            per_row_s = max(float(e.compute_s) - float(e.optimizer_s), 0.0) / n0
            act = float(e.memory.activations_bytes)
            fixed_bytes = float(e.memory.peak_bytes) - act
            dev = cluster.device(r)
            if fixed_bytes > dev.memory_bytes:
                raise PlanInfeasibleError(
                    f"{_device_text(dev, mapping[r])} has {dev.memory_bytes / 2**20:,.0f} MiB, but its share of the model's "
                    f"state alone (parameters, gradients, optimizer state) needs {fixed_bytes / 2**20:,.0f} MiB under "
                    f"plan {mesh}: it is too small for any rows; use a plan that shards the state (fsdp, tp), or a "
                    "cluster without that device")
            per_row_bytes = act / n0
            if per_row_bytes > 0:
                cap = min(cap, math.floor((dev.memory_bytes - fixed_bytes) / per_row_bytes))
            scale = 1.0 if time_scale is None else float(time_scale[r])
            models.append((scale * float(e.optimizer_s), scale * per_row_s))
        times.append(lambda n, ms=tuple(models): max(f + p * n for f, p in ms))
        caps.append(None if cap == math.inf else int(cap))
    try:
        return balanced_rows(batch_size, times, caps)
    except UsageError:
        devs = ", ".join(f"{_device_text(cluster.device(r), mapping[r])}: {cluster.device(r).memory_bytes / 2**20:,.0f} MiB"
                         for r in range(mesh.world_size))
        raise PlanInfeasibleError(
            f"the batch of {batch_size} rows does not fit the devices' memory under plan {mesh}: at most "
            f"{[c if c is not None else 'any' for c in caps]} rows per coordinate of {axis!r} ({devs}); use a "
            "smaller --batch-size, activation checkpointing, or a plan that shards more") from None


def _device_text(dev: Any, device: int) -> str:
    """``device 2 (cpu on localhost, cpus [1])``, plus the program rank when the mapping moved it."""
    cpus = f", cpus {list(dev.cpus)}" if getattr(dev, "cpus", None) is not None else ""
    moved = f", running rank {dev.rank}" if dev.rank != device else ""
    return f"device {device} ({dev.kind} on {dev.host}{cpus}{moved})"


def device_table(programs: dict[int, Any], cluster: Any, estimate: Any):
    """A ``rich.table.Table`` of each rank's device and load: the device it runs on (host, cpus), its float32
    GFLOP/s, the batch rows it takes, its predicted peak memory against the device's, and its predicted compute
    and step time (``estimate``: :func:`~adaptdist.cost_models.estimate.estimate_programs` of ``programs`` on
    :func:`~adaptdist.device_assignment.program_cluster`)."""
    from rich.table import Table

    plan = programs[min(programs)].plan
    devices = plan.devices if plan is not None else None
    table = Table(title="devices: load, memory and predicted time per rank")
    for col in ("rank", "device", "GFLOP/s", "batch rows", "peak MiB / device MiB", "compute ms", "step ms"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for r, p in sorted(programs.items()):
        d = devices.device_of(r) if devices is not None else r
        dev = cluster.device(d)
        cpus = f" cpus {list(dev.cpus)}" if dev.cpus is not None else ""
        e = estimate.ranks[r]
        off, rows = p.batch_slice
        table.add_row(str(r), f"{d}: {dev.kind}@{dev.host}{cpus}", f"{dev.peak_flops['float32'] / 1e9:,.1f}",
                      f"{rows} [{off}:{off + rows})", f"{e.memory.peak_bytes / 2**20:,.1f} / {dev.memory_bytes / 2**20:,.0f}",
                      f"{e.compute_s * 1e3:,.3f}", f"{e.step_s * 1e3:,.3f}")
    return table


def placement_line(plan: Any) -> str:
    """One line: the batch rows and the rank mapping of ``plan.devices``, and why."""
    d = getattr(plan, "devices", None)
    if d is None:
        split = "batch split by torch.chunk" if getattr(plan, "batch_axis", None) else "batch replicated"
        return f"devices: {split}, rank r on device r"
    rows = f"batch rows {list(d.batch_rows)}" if d.batch_rows is not None else "batch split by torch.chunk"
    mapping = (f"rank -> device {list(d.rank_to_device)}" if d.rank_to_device is not None else "rank r on device r")
    return f"devices: {rows}; {mapping} ({d.reason})" if d.reason else f"devices: {rows}; {mapping}"


def draw_devices(programs: dict[int, Any], cluster: Any, estimate: Any, path: Any) -> None:
    """A PNG at ``path``: per rank, the batch rows it takes and its predicted compute and step time, each bar
    labelled with the device the mapping puts it on (host, cpus); the mesh coordinates in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = programs[min(programs)].plan
    devices = plan.devices if plan is not None else None
    ranks = sorted(programs)
    labels = []
    for r in ranks:
        d = devices.device_of(r) if devices is not None else r
        dev = cluster.device(d)
        cpus = f"\ncpus {list(dev.cpus)}" if dev.cpus is not None else ""
        labels.append(f"rank {r}\ndevice {d} @{dev.host}{cpus}")
    fig, (ax_rows, ax_t) = plt.subplots(1, 2, figsize=(4 + 1.4 * len(ranks), 3.6))
    ax_rows.bar(range(len(ranks)), [programs[r].batch_slice[1] for r in ranks], color="#4c72b0")
    ax_rows.set_title("batch rows per rank")
    step = [estimate.ranks[r].step_s * 1e3 for r in ranks]
    comp = [estimate.ranks[r].compute_s * 1e3 for r in ranks]
    ax_t.bar(range(len(ranks)), step, color="#dddddd", label="step (predicted)")
    ax_t.bar(range(len(ranks)), comp, color="#dd8452", label="compute (predicted)")
    ax_t.set_title("predicted time per rank, ms")
    ax_t.legend(loc="lower right", fontsize=7)
    for ax in (ax_rows, ax_t):
        ax.set_xticks(range(len(ranks)), labels, fontsize=7)
    mesh = ",".join(f"{a}={n}" for a, n in programs[ranks[0]].mesh.items())
    fig.suptitle(f"mesh {mesh}: {placement_line(plan).removeprefix('devices: ')}"[:140], fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
