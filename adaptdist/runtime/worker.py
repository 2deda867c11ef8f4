"""What each rank runs: load its RankProgram, train it for some steps, checkpoint.

The optimizer is an ordinary ``torch.optim`` optimizer over the rank's own
parameter tensors; the program returns the (already all-reduced) gradients,
which are set as ``.grad`` before ``optimizer.step()``.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from ..errors import AdaptdistError, DataError
from ..model_spec import load_module
from ..program import RankProgram, load_program
from .grad_clip import clip_grad_norm_
from .memory import PeakMemory


@dataclass(frozen=True)
class DataSpec:
    """Where global batches come from: ``module_file``'s ``function(batch_size, seq_len, path=, seed=)``,
    or, with ``function=None``, the example batch saved at ``batch_file`` repeated."""

    module_file: str
    function: str | None
    batch_size: int
    seq_len: int
    path: str | None = None
    seed: int = 0
    batch_file: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Settings of the step loop (see ``adaptdist train --help``)."""

    program_dir: str
    out_dir: str
    data: DataSpec
    steps: int
    lr: float
    optimizer: str = "adamw"
    seed: int = 0
    threads_per_rank: int = 1
    timeout_s: float = 300.0
    backend: str = "gloo"
    progress: bool = True
    checkpoint: bool = True
    measure_memory_step: int | None = None
    items_per_step: int = 1
    unit: str = "tokens"
    max_grad_norm: float | None = None
    extra: dict = field(default_factory=dict)


def global_batches(spec: DataSpec) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless global batches per ``spec`` (the same on every rank)."""
    if spec.function is None:
        from safetensors.torch import load_file

        tensors = load_file(spec.batch_file)
        return _repeat(tuple(tensors[f"b{i}"] for i in range(len(tensors))))
    mod = load_module(spec.module_file, "adaptdist_data_module")
    fn = getattr(mod, spec.function)
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "path" in params:
        kwargs["path"] = spec.path
    elif spec.path:
        raise DataError(f"--data was given but {spec.module_file}:{spec.function} takes no 'path' argument")
    if "seed" in params:
        kwargs["seed"] = spec.seed
    return iter(fn(spec.batch_size, spec.seq_len, **kwargs))


def _repeat(batch: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    while True:
        yield batch


def make_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` or ``AdamW`` over ``params`` at learning rate ``lr``, otherwise with torch's
    defaults (AdamW: ``weight_decay=0.01``, betas (0.9, 0.999), eps 1e-8), as a user's own loop would build it.

    Raises:
        AdaptdistError: an unknown optimizer name.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise AdaptdistError(f"unknown optimizer {name!r}; use sgd or adamw")


class StepRunner:
    """Holds one rank's state and optimizer and runs training steps of its program."""

    def __init__(self, program: RankProgram, optimizer: str, lr: float, max_grad_norm: float | None = None):
        self.program = program
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self.state = {k: v.clone() for k, v in program.state.items()}
        self.inputs = [self.state[f] for f in program.input_fqns]
        self.params = [self.state[f] for f in program.param_fqns]
        self.opt = make_optimizer(optimizer, self.params, lr)
        self.grad_slots = [program.output_roles.index(f"grad:{f}") for f in program.param_fqns]
        self.last_grads: dict[str, torch.Tensor] = {}
        self.buffer_slots = [(i, r.split(":", 1)[1]) for i, r in enumerate(program.output_roles)
                             if r.startswith("buffer:")]

    def step(self, global_batch: tuple[torch.Tensor, ...]) -> float:
        """One training step on this rank's rows of ``global_batch``; returns the (global) loss."""
        outs = self.program(*self.inputs, *self.program.local_batch(global_batch))
        self.last_grads = {f: outs[i] for f, i in zip(self.program.param_fqns, self.grad_slots)}
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(self.last_grads, self.program, self.max_grad_norm)
        for p, i in zip(self.params, self.grad_slots):
            p.grad = outs[i]
        self.opt.step()
        for p in self.params:
            p.grad = None
        with torch.no_grad():
            for i, fqn in self.buffer_slots:
                self.state[fqn].copy_(outs[i])
        return float(outs[self.program.loss_index])

    def optimizer_state_by_fqn(self) -> dict:
        """The optimizer's per-parameter state keyed by parameter name (for checkpoints)."""
        sd = self.opt.state_dict()
        return {self.program.param_fqns[i]: s for i, s in sd["state"].items()}


def _init_distributed(cfg: TrainConfig) -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    return rank, world


def register_mesh_groups(program: RankProgram, backend: str):
    """Build torch's DeviceMesh for the program's mesh and register this rank's group of each axis
    under the name the program's collectives use; returns the DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(program.mesh)
    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, tuple(program.mesh.values()), mesh_dim_names=names)
    for axis, name in program.group_names.items():
        compat.register_process_group(name, mesh.get_group(axis) if len(names) > 1 else dist.group.WORLD)
    return mesh


def run_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Entry point of one rank (called by the elastic agent). Returns metrics on rank 0."""
    torch.set_num_threads(cfg.threads_per_rank)
    rank, world = _init_distributed(cfg)
    # Independent random streams per rank (dropout masks must not repeat across ranks).
    torch.manual_seed(cfg.seed + rank)
    try:
        # Every rank's initial state comes from the programs one process wrote (train/compile lower one model
        # in one process and save each rank's part of its state), so replicated parameters start equal on
        # every rank and nothing needs broadcasting (the torch.compile backend, where each rank builds its own
        # model, broadcasts rank 0's: CompiledStep._broadcast_state).
        program = load_program(cfg.program_dir, rank, world_size=world)
        device_mesh = register_mesh_groups(program, cfg.backend)
        runner = StepRunner(program, cfg.optimizer, cfg.lr, cfg.max_grad_norm)
        batches = global_batches(cfg.data)
        losses, times = [], []
        peak = None
        bar = _Progress(cfg.steps, enabled=cfg.progress and rank == 0, unit=cfg.unit)
        with bar:
            for step in range(cfg.steps):
                batch = next(batches, None)
                if batch is None:
                    raise DataError(
                        f"{cfg.data.module_file}:{cfg.data.function} stopped after {step} batches but "
                        f"--steps is {cfg.steps}; make data() yield batches endlessly (e.g. loop over epochs)"
                    )
                t0 = time.perf_counter()
                if cfg.measure_memory_step == step:
                    with PeakMemory([runner.state, runner.opt.state_dict()["state"], batch]) as pm:
                        loss = runner.step(batch)
                    peak = pm.report
                else:
                    loss = runner.step(batch)
                dt = time.perf_counter() - t0
                losses.append(loss)
                times.append(dt)
                bar.update(step + 1, loss, cfg.items_per_step / dt)
        if cfg.checkpoint:
            _checkpoint(cfg, runner, rank, device_mesh)
        dist.barrier()
        warm = times[min(2, len(times) - 1):] or times
        return {
            "rank": rank,
            "losses": losses,
            "step_time_s": statistics.median(warm),
            "items_per_s": cfg.items_per_step / statistics.median(warm),
            "peak_bytes": peak.peak_bytes if peak else None,
            "rss_peak_bytes": peak.rss_peak_bytes if peak else None,
        }
    finally:
        dist.destroy_process_group()


def _checkpoint(cfg: TrainConfig, runner: StepRunner, rank: int, device_mesh) -> None:
    """Write a torch.distributed.checkpoint of model and optimizer state, and (rank 0) model.safetensors.

    Sharded tensors are saved as DTensors with their placement and global shape, so the
    checkpoint holds every shard once and can be loaded onto another layout. A tensor dim sharded
    on two mesh axes is described over a mesh in lowering order where that differs from the mesh's
    (:mod:`.checkpoint`; building that mesh is collective, like the save).
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from .checkpoint import as_global, ordered_device_mesh

    out = Path(cfg.out_dir)
    program = runner.program
    ordered = ordered_device_mesh(device_mesh, program)
    # the same order on every rank (full_tensor below is collective); runner.state comes in the order of this
    # rank's state.safetensors, which can differ between ranks when shard sizes differ
    names = list(program.input_fqns) + sorted(set(runner.state) - set(program.input_fqns))
    model = {f: as_global(runner.state[f], f, program, device_mesh, ordered) for f in names}
    optim = {f: {k: as_global(v, f, program, device_mesh, ordered) if isinstance(v, torch.Tensor) and v.dim() else v
                 for k, v in st.items()}
             for f, st in runner.optimizer_state_by_fqn().items()}
    writer = dcp.FileSystemWriter(str(out / "checkpoint"), overwrite=True)
    dcp.save({"model": model, "optim": optim}, storage_writer=writer)
    full = {f: (t.full_tensor() if hasattr(t, "full_tensor") else t) for f, t in model.items()}  # collective
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors"))



LOSS_SUMMARY_WINDOW = 5
"""The closing summary of train and run compares the first loss with the mean of up to this many last steps."""


def loss_summary(losses: list[float]) -> tuple[dict[str, Any], str]:
    """The closing loss summary of ``adaptdist train`` and ``adaptdist run`` (one wording for both): the first
    step's loss against the mean of the last ``min(LOSS_SUMMARY_WINDOW, steps - 1)`` steps (never the first
    step itself, so a short run still compares two things; a 1-step run has only its loss).

    Returns:
        ``(fields, text)``: ``fields`` for summary.json (``initial_loss``, ``final_loss``, ``last_mean_loss``,
        ``last_mean_steps``, ``last_mean_over_initial``; the last three None for fewer than 2 steps) and the
        text, e.g. ``loss 2.301 -> 1.207 (mean of steps 96-100; x0.52 of step 1)``.
    """
    n = len(losses)
    if n == 0:
        return {"initial_loss": None, "final_loss": None, "last_mean_loss": None, "last_mean_steps": 0,
                "last_mean_over_initial": None}, "no steps"
    first = losses[0]
    fields: dict[str, Any] = {"initial_loss": first, "final_loss": losses[-1], "last_mean_loss": None,
                              "last_mean_steps": 0, "last_mean_over_initial": None}
    if n == 1:
        return fields, f"loss {first:.3f} (1 step)"
    k = min(LOSS_SUMMARY_WINDOW, n - 1)
    mean = sum(losses[-k:]) / k
    ratio = mean / first if first else float("nan")
    fields.update(last_mean_loss=mean, last_mean_steps=k, last_mean_over_initial=ratio)
    which = f"step {n}" if k == 1 else f"mean of steps {n - k + 1}-{n}"
    return fields, f"loss {first:.3f} -> {mean:.3f} ({which}; x{ratio:.2f} of step 1)"


class _Progress:
    """A rich progress bar on rank 0 (step, loss, tokens/s); plain log lines when not a terminal."""

    def __init__(self, total: int, enabled: bool, unit: str = "tokens"):
        self.total, self.enabled = total, enabled
        self.unit = "tok" if unit == "tokens" else unit
        self._p = None
        self._last_log = 0.0

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        if self.console.is_terminal:
            self._p = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} " + self.unit + "/s"),
                               TimeRemainingColumn(), console=self.console)
            self._task = self._p.add_task("train", total=self.total, loss=float("nan"), tps=0.0)
            self._p.__enter__()
        return self

    def update(self, step: int, loss: float, items_per_s: float) -> None:
        if not self.enabled:
            return
        if self._p is not None:
            self._p.update(self._task, completed=step, loss=loss, tps=items_per_s)
        elif step == 1 or step == self.total or time.monotonic() - self._last_log > 5:
            self._last_log = time.monotonic()
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {items_per_s:,.0f} {self.unit}/s")

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False
