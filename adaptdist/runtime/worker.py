"""What each rank runs: load its RankProgram, train it for some steps, checkpoint.

The optimizer is an ordinary ``torch.optim`` optimizer over the rank's own
parameter tensors; the program returns the (already all-reduced) gradients,
which are set as ``.grad`` before ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from ..errors import AdaptdistError, CheckpointError, DataError
from ..model_spec import load_module
from ..program import RankProgram, load_program
from .grad_clip import clip_grad_norm_
from .memory import PeakMemory
from .trace import TraceRecorder


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
    batch_shapes: tuple | None = None
    """The compiled global batch (:data:`.batch_check.BatchShapes`: each tensor's shape and dtype): every batch is
    checked against it before it reaches the programs; None: against the first batch drawn."""


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
    trace: bool = False
    """Record every rank's spans (:mod:`.trace`) into ``OUT/trace/rank{r}.json``."""
    measure_memory_step: int | None = None
    items_per_step: int = 1
    unit: str = "tokens"
    max_grad_norm: float | None = None
    extra: dict = field(default_factory=dict)
    checkpoint_every: int | None = None
    keep: int | None = 3
    model_name: str = ""
    run_meta: dict = field(default_factory=dict)
    program_source: Any = None
    """``compiler.replan.ProgramSource`` for an elastic job (programs for other world sizes), or None."""
    async_checkpoint: bool = False
    """Write checkpoints with DCP's asynchronous save (staged to CPU, written in a thread while training goes on;
    the directory is committed once every rank's write finished, at the next checkpoint or the end)."""
    first_attempt: int = 0
    """The attempt number of this launch's first attempt (attempts of earlier launches of the run, e.g. before a
    ``--resume``, keep their records under ``OUT/status``); a later one is a restart."""
    rng: str = "per-rank"
    """``"global"``: every rank seeds torch with ``seed`` alike (programs lowered with ``LoweringOptions.rng =
    "global"``, see ``passes/global_rng.py``); ``"per-rank"``: rank r seeds ``seed + r``."""
    cpus_of_rank: tuple = ()
    """Rank r -> the CPU core ids its process is pinned to (the cluster file's ``cpus`` of the device the rank
    mapping puts it on; None: not pinned), applied before torch's threads start, with ``len(cpus)`` threads
    (:mod:`.affinity`); empty: no rank is pinned (``threads_per_rank`` threads each)."""
    rebalance_after: int | None = None
    """Re-balance the batch rows once after this many steps of each attempt, from the compute per step each rank
    measured in them (:mod:`.rebalance`; the first step is not measured); None: never. Needs ``program_source``
    (it lowers the new programs) and ``rebalance_cluster``."""
    rebalance_cluster: Any = None
    """The cluster the programs were placed on (``--cluster``), for the re-balance's cost model and lowering."""
    devices_of_rank: tuple = ()
    """Rank r -> its :class:`~.devices.RankDevice` (:func:`~.devices.rank_devices`): where its state, batch and
    optimizer live; empty: every rank on cpu."""


def global_batches(spec: DataSpec, start_step: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless global batches per ``spec`` (the same on every rank); ``start_step`` is passed to a ``data()`` that
    takes it (see :func:`positioned_batches`).

    Raises:
        DataError: (as a batch is drawn) a batch whose count, shapes or dtypes differ from ``spec.batch_shapes``
            (:mod:`.batch_check`; names the 1-based step).
    """
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
    if start_step is not None:
        kwargs["start_step"] = start_step
    from .batch_check import checked_batches

    return checked_batches(iter(fn(spec.batch_size, spec.seq_len, **kwargs)), spec.batch_shapes,
                           f"{spec.module_file}:{spec.function}", first_step=(start_step or 0) + 1,
                           compiled="the factory's example batch" if spec.batch_shapes is not None else "",
                           sizes=f"--batch-size {spec.batch_size} --seq-len {spec.seq_len}")


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

    def __init__(self, program: RankProgram, optimizer: str, lr: float, max_grad_norm: float | None = None,
                 device: torch.device | None = None):
        self.device = torch.device("cpu") if device is None else device
        if self.device.type != "cpu":  # the program's constants and device arguments on this rank's device
            from .devices import program_on_device

            program = program_on_device(program, self.device)
        self.program = program
        self.trace = TraceRecorder(program.rank, enabled=False)
        self._run = program
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self.state = {k: v.clone().to(self.device) for k, v in program.state.items()}
        self.inputs = [self.state[f] for f in program.input_fqns]
        self.params = [self.state[f] for f in program.param_fqns]
        self.opt = make_optimizer(optimizer, self.params, lr)
        self.grad_slots = [program.output_roles.index(f"grad:{f}") for f in program.param_fqns]
        self.last_grads: dict[str, torch.Tensor] = {}
        # with an axis on shared memory, drop the last step's gradients before the next step: an all_reduce output
        # region is reused (and a registered bucket read in place) only once free. Not on gloo: there it cost the
        # busiest rank 3-5 ms more CPU a step (bench_dp 2x32, 2026-12-04 17:36; benchmarks/RESULTS.md)
        self.drop_grads_first = "shm" in program_transports(program).values()
        self.buffer_slots = [(i, r.split(":", 1)[1]) for i, r in enumerate(program.output_roles)
                             if r.startswith("buffer:")]

    def step(self, global_batch: tuple[torch.Tensor, ...]) -> float:
        """One training step on this rank's rows of ``global_batch``; returns the (global) loss."""
        if self.drop_grads_first:
            self.last_grads = {}
        try:
            batch = self.program.local_batch(global_batch)
            if self.device.type != "cpu":
                from .devices import to_device

                batch = to_device(batch, self.device)
            outs = self._run(*self.inputs, *batch)
        except RuntimeError as e:  # a shared-memory collective's peer died or stalled: the typed error naming it
            from ..kernels.shm import translate_error

            typed = translate_error(e)
            if typed is None:
                raise
            raise typed from e
        self.last_grads = {f: outs[i] for f, i in zip(self.program.param_fqns, self.grad_slots)}
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(self.last_grads, self.program, self.max_grad_norm)
        with self.trace.span("optimizer"):
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

    def use_trace(self, trace: TraceRecorder) -> None:
        """Record each step's forward, backward, collectives and optimizer into ``trace`` (when enabled)."""
        self.trace = trace
        self._run = _traced_program(self.program, trace) if trace.enabled else self.program


def _traced_program(program: RankProgram, trace: TraceRecorder):
    """``program``'s step with its collectives and its forward/backward boundary recorded into ``trace``
    (:func:`.trace.instrument_collectives` on an FX trace of its code); when its code cannot be traced, the
    program itself inside one ``FB`` span."""
    import torch.fx

    from .trace import instrument_collectives

    forward = [i for i, r in enumerate(program.output_roles) if r == "loss" or r.startswith("buffer:")]
    try:
        gm = program.module if isinstance(program.module, torch.fx.GraphModule) else torch.fx.symbolic_trace(
            program.module)
        return instrument_collectives(gm, trace, forward_outputs=forward)
    except Exception as e:  # noqa: BLE001 - a trace is a view; the step must run regardless
        print(f"adaptdist: rank {program.rank}: --trace records forward and backward as one span ({type(e).__name__}: "
              f"{e})", file=sys.stderr, flush=True)

        def step(*args):
            with trace.span("FB"):
                return program(*args)

        return step


def rank_device(cfg: TrainConfig, rank: int) -> torch.device:
    """(In the rank's process, before ``init_process_group``) this rank's device from ``cfg.devices_of_rank``, made
    the current CUDA device on a cuda rank; cpu where the config names none.

    Raises:
        DeviceUnavailableError: a cuda rank on a machine without that device (:func:`.devices.bind_device`).
    """
    if rank >= len(cfg.devices_of_rank):
        return torch.device("cpu")
    from .devices import bind_device

    return bind_device(cfg.devices_of_rank[rank])


def _init_distributed(cfg: TrainConfig) -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    return rank, world


def register_mesh_groups(program: RankProgram, backend: str, timeout_s: float | None = None,
                         device_type: str | None = None):
    """Build torch's DeviceMesh for the program's mesh and register this rank's group of each axis
    under the name the program's collectives use; returns the DeviceMesh. The axes whose collectives the program
    carries through shared memory (``torch.ops.adaptdist.shm_*``) get their shared-memory group too
    (:func:`~adaptdist.runtime.shm_groups.setup_shm_groups`, collective timeout ``timeout_s``); under ``--comm auto``
    (``program.comm``) an axis whose group /dev/shm has no room for goes to gloo on every rank, with one warning, and
    the program is rewritten for it (:func:`~adaptdist.runtime.shm_groups.use_gloo_for_axes`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from .shm_groups import setup_shm_groups_or_gloo, use_gloo_for_axes

    names = tuple(program.mesh)
    device = device_type or ("cuda" if backend == "nccl" else "cpu")  # the rank's tensors' device type
    mesh = init_device_mesh(device, tuple(program.mesh.values()), mesh_dim_names=names)

    def group(axis: str):
        return mesh.get_group(axis) if len(names) > 1 else dist.group.WORLD

    for axis, name in program.group_names.items():
        compat.register_process_group(name, group(axis))
    _, gloo_axes = setup_shm_groups_or_gloo(program.code, program.group_names, group, timeout_s,
                                            fall_back=getattr(program, "comm", "") == "auto")
    use_gloo_for_axes(program, gloo_axes)
    return mesh


def program_transports(program: Any) -> dict[str, str]:
    """Mesh axis -> the transport its collectives take in ``program`` (``"shm"``, ``"gloo"``; ``"none"`` for an axis
    of size 1), from its source (:func:`~adaptdist.comm_transport.transports_of_code`); a pipeline rank's view
    carries its program's (``CheckpointView.transports``: ``pp`` on gloo, the stage's axes as their groups go);
    else gloo on every axis of size > 1."""
    from ..comm_transport import transports_of_code

    if getattr(program, "transports", None):
        return dict(program.transports)
    code, names, mesh = getattr(program, "code", None), getattr(program, "group_names", None), program.mesh
    if not isinstance(code, str) or not isinstance(names, dict):
        return {a: "none" if int(n) == 1 else "gloo" for a, n in dict(mesh).items()}
    return transports_of_code(code, names, mesh)


def _shm_all_reduce_counts(program: Any) -> dict[str, int] | None:
    """This rank's large shared-memory all_reduces of the run and how many read their inputs in place
    (:func:`adaptdist.kernels.shm.all_reduce_counts`); None when no axis is on shared memory."""
    if "shm" not in program_transports(program).values():
        return None
    from ..kernels.shm import all_reduce_counts

    return all_reduce_counts()


def describe_program(program: RankProgram) -> str:
    """``plan 'dp' on mesh dp=2 (2 ranks)``: one line for restart and re-plan logs."""
    if getattr(program, "description", None):  # a pipeline rank's CheckpointView
        return program.description
    mesh = ",".join(f"{a}={n}" for a, n in program.mesh.items())
    name = program.plan.name if program.plan is not None else "?"
    return f"plan {name!r} on mesh {mesh} ({program.world_size} ranks)"


def _pipeline_runner(program_dir: str, rank: int, world: int, cfg: "TrainConfig"):
    """(Collective) a pipeline rank's (checkpoint view, None, PipelineStepRunner) for ``run_worker``: its program
    loaded, every process group made, the view of its state gathered (:mod:`adaptdist.stage_program_io`, :mod:`.pipeline_programs`)."""
    import dataclasses

    from .pipeline_executor import PipelineStepRunner, setup_pipeline_groups_or_gloo
    from ..stage_program_io import load_pipeline_program
    from .pipeline_programs import checkpoint_view, describe_pipeline, stage_device_mesh

    program = load_pipeline_program(program_dir, rank, world_size=world)
    program, groups = setup_pipeline_groups_or_gloo(program, cfg.timeout_s)  # --comm auto: gloo where /dev/shm is full
    runner = PipelineStepRunner(program, cfg.optimizer, cfg.lr, groups, timeout_s=cfg.timeout_s,
                                max_grad_norm=cfg.max_grad_norm, make_optimizer=make_optimizer)
    view = dataclasses.replace(checkpoint_view(program), description=describe_pipeline(program),
                               transports=program.transports())
    return view, stage_device_mesh(program), runner


def _newest_checkpoint(root: Path, note) -> tuple[str, dict] | str | None:
    """(path, meta) of the newest good checkpoint under ``root``, None when there is none, ``"unusable"`` when
    there are some but none passes its checks (each one named through ``note``)."""
    from .checkpoint_store import latest_good, list_checkpoints, resume_note

    info = latest_good(root, note)
    why = resume_note(root, info)  # a later checkpoint begun and never committed (a rank died during its write)
    if why is not None and (info is not None or not list_checkpoints(root)):
        note(why)
    if info is not None:
        return str(info.path), info.meta
    return "unusable" if list_checkpoints(root) else None


def _next_attempt(out_dir: str) -> int:
    """The number of the attempt starting now: one past the newest ``OUT/status/attempt{A}`` (0 for none)."""
    found = [int(p.name[len("attempt"):]) for p in (Path(out_dir) / "status").glob("attempt*")
             if p.name[len("attempt"):].isdigit()]
    return max(found) + 1 if found else 0


def first_attempt_of_launch(out_dir: str) -> int:
    """The attempt number this launch started at, for a worker that torch's agent may have restarted: the next
    attempt less the agent's restarts so far (``TORCHELASTIC_RESTART_COUNT``), so that a second launch into the
    same ``--out`` is not reported as a restart of the first."""
    from .launch import restart_count

    return max(0, _next_attempt(out_dir) - restart_count())


def _broadcast(value: Any, rank: int) -> Any:
    """Rank 0's ``value`` on every rank (a pickled object over the default group: our own ranks only)."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _publish(path: str | None, rank: int, attempt: int, wait_s: float) -> str:
    """Rank 0's ``path`` on every rank through the job's store, waited for up to ``wait_s`` seconds (a compile may
    outlast the collective timeout a broadcast would have)."""
    store = compat.default_group_store()
    key = f"adaptdist/programs/{attempt}"
    if rank == 0:
        store.set(key, path)
        return path
    store.wait([key], timedelta(seconds=wait_s))
    return store.get(key).decode()


def positioned_batches(spec: DataSpec, start_step: int, note) -> Iterator[tuple[torch.Tensor, ...]]:
    """Global batches from step ``start_step`` on (0-based: the batch of the step after ``start_step`` steps):
    the model file's ``data(..., start_step=)`` when it takes that argument, else batches replayed from the
    start and dropped (``note`` says so once)."""
    if start_step == 0 or spec.function is None:
        return global_batches(spec)
    mod = load_module(spec.module_file, "adaptdist_data_module")
    if "start_step" in inspect.signature(getattr(mod, spec.function)).parameters:
        return global_batches(spec, start_step=start_step)
    it = global_batches(spec)
    t0 = time.perf_counter()
    for i in range(start_step):
        if next(it, None) is None:
            raise DataError(f"{spec.module_file}:{spec.function} stopped after {i} batches while replaying to step "
                            f"{start_step}; make data() yield batches endlessly")
    note(f"{spec.module_file}:{spec.function} takes no start_step=: replayed {start_step} batches to reach step "
         f"{start_step} ({time.perf_counter() - t0:.1f} s)")
    return it


def _rng_rank(cfg: TrainConfig, rank: int) -> int:
    """What rank ``rank`` adds to the seed: itself (per-rank streams), or 0 under ``rng="global"`` (one stream)."""
    return 0 if cfg.rng == "global" else rank


def _restore_rank0_rng(directory: Path) -> bool:
    """Set this process's RNG to the state rank 0 saved in checkpoint ``directory``; False if it saved none."""
    from .train_state import RNG_DIR, _restore_rng

    if not (directory / RNG_DIR / "rank0.safetensors").is_file():
        return False
    _restore_rng(directory, 0)
    return True


def run_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Entry point of one rank (called by the elastic agent, again after each restart). Returns metrics on rank 0.

    Resumes from the newest good checkpoint under ``OUT/checkpoints`` when there is one (after a restart, or
    for ``--resume``), resharded into this world size's programs; checkpoints every ``checkpoint_every`` steps,
    on a stop signal (SIGTERM, SIGINT: every rank stops after the same step, then exits 128 + the signal) and
    at the end. A stop signal at the last step, or while the run's last files are written, is noted and the run
    finishes (weights, ``result.json``): nothing would be left to resume.
    """
    from .checkpoint_store import check_same_model
    from .faults import Fault
    from .heartbeat import Heartbeat, named_timeout
    from .rank_status import RankStatus, failure_of
    from .stop import StopRequest
    from .train_state import check_identical_replicas, load_train_state, state_shapes

    from .affinity import pin_to_cpus

    own = int(os.environ.get("RANK", 0))
    if pin_to_cpus(cfg.cpus_of_rank[own] if own < len(cfg.cpus_of_rank) else None, own) is None:
        torch.set_num_threads(cfg.threads_per_rank)
    device = rank_device(cfg, own)
    rank, world = _init_distributed(cfg)
    # one attempt number for the whole job (an elastic job's agents count their restarts each on its own)
    attempt = _broadcast(_next_attempt(cfg.out_dir), rank)
    status = RankStatus(cfg.out_dir, rank, attempt)
    restarted = attempt > cfg.first_attempt
    pinned = cfg.cpus_of_rank[rank] if rank < len(cfg.cpus_of_rank) else None
    print(f"rank {rank}: pid {os.getpid()} on {socket.gethostname()}"
          + (f", pinned to cpus {list(pinned)}" if pinned is not None else "")
          + (f", on {device}" if device.type != "cpu" else "")
          + (f" (restart {attempt - cfg.first_attempt})" if restarted else ""), file=sys.stderr, flush=True)
    fault = Fault.from_env()
    events = _Events(cfg.out_dir, enabled=rank == 0)
    step = 0
    from contextlib import ExitStack

    stops = ExitStack()  # the StopRequest's handlers, from the first step until the run's last file is written
    try:
        if restarted and rank == 0:
            events.add("restart", attempt=attempt - cfg.first_attempt, world_size=world,
                       cause=failure_of(cfg.out_dir, attempt - 1) or "unknown (no rank left a record)")
        program_dir = cfg.program_dir
        if cfg.program_source is not None:
            wait_s = getattr(cfg.program_source, "compile_wait_s", cfg.timeout_s)
            program_dir = cfg.program_source.program_dir(world, rank, lambda p: _publish(p, rank, attempt, wait_s),
                                                         events.note,
                                                         local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        from ..stage_program_io import is_pipeline_directory

        if is_pipeline_directory(program_dir):  # a pipeline plan: `program` is its checkpoint view, the mesh its stage's
            program, device_mesh, runner = _pipeline_runner(program_dir, rank, world, cfg)
        else:
            program = load_program(program_dir, rank, world_size=world)
            device_mesh = register_mesh_groups(program, cfg.backend, cfg.timeout_s, device_type=device.type)
            runner = StepRunner(program, cfg.optimizer, cfg.lr, cfg.max_grad_norm, device=device)
        losses: list[float] = []
        found = _broadcast(_newest_checkpoint(Path(cfg.out_dir) / "checkpoints", events.note) if rank == 0 else None,
                           rank)
        if found == "unusable":
            raise CheckpointError(f"none of the checkpoints in {Path(cfg.out_dir) / 'checkpoints'} is usable (see the "
                                  "lines above): stopping rather than training again from step 0")
        start = 0
        if found is not None:
            path, meta = found
            check_same_model(meta, Path(path), cfg.model_name, state_shapes(program))
            same_world = meta.get("world_size") == world
            # rank 0 verified the checksums (latest_good) before any rank reads the directory
            load_train_state(Path(path), program, runner.state, runner.opt, device_mesh, rank, restore_rng=same_world,
                             verify=False)
            if not getattr(program, "description", None):  # (a pipeline's stage mesh has no process groups)
                check_identical_replicas(program, runner.state, runner.opt, device_mesh)
            start, losses = int(meta["step"]), list(meta.get("losses", []))
            # rng="global": one stream, the same on every rank whatever the world size: the saver's rank 0's state;
            # otherwise a fresh stream per rank and step (the saver's ranks were others)
            if not same_world and not (cfg.rng == "global" and _restore_rank0_rng(Path(path))):
                torch.manual_seed((cfg.seed + _rng_rank(cfg, rank) + 1_000_003 * start) % 2**63)
            events.add("resume", checkpoint=path, step=start, saved_world_size=meta.get("world_size"),
                       saved_plan=meta.get("plan_line"), plan=describe_program(program), world_size=world)
        else:
            # per-rank: independent random streams per rank (dropout masks must differ); global: one stream, the same
            # on every rank (each draws whole tensors and keeps its shard, as one process draws them)
            torch.manual_seed(cfg.seed + _rng_rank(cfg, rank))
        if start >= cfg.steps:
            events.note(f"the checkpoint is at step {start}, --steps is {cfg.steps}: nothing to train")
        batches = positioned_batches(cfg.data, start, events.note)
        trace = TraceRecorder(rank, enabled=cfg.trace)
        if cfg.trace:
            if hasattr(runner, "use_trace"):  # use_trace(TraceRecorder): StepRunner's below, a pipeline runner's own
                runner.use_trace(trace)
            else:
                events.note(f"--trace: {type(runner).__name__} records no spans inside a step (no use_trace)")
            trace.align_clocks()  # (collective) every rank's time origin right after one barrier
        meter, rebalance_at = None, None
        if cfg.rebalance_after and cfg.program_source is not None and cfg.rebalance_cluster is not None:
            if isinstance(runner, StepRunner) and world == cfg.rebalance_cluster.world_size:
                from .rebalance import ComputeMeter

                meter, rebalance_at = ComputeMeter(runner, trace), start + cfg.rebalance_after
            else:
                events.note("no re-balance of the batch rows: " + ("a pipeline plan" if not isinstance(runner, StepRunner)
                                                                 else f"{world} ranks, planned for "
                                                                      f"{cfg.rebalance_cluster.world_size}"))
        heartbeat = Heartbeat(rank, world, status_dir=status.path.parent)
        times: list[float] = []
        checkpoint_times: list[float] = []
        ends: list[float] = []  # each step's end, for the interval between steps (data loading included)
        cpu_in_steps_s = 0.0  # this process's CPU seconds inside the steps (every thread's)
        pending = None  # an asynchronous checkpoint not committed yet
        async_group = None
        if cfg.async_checkpoint and cfg.checkpoint:
            from .train_state import checkpoint_process_group

            async_group = checkpoint_process_group()
        peak = None
        bar = _Progress(cfg.steps, enabled=cfg.progress and rank == 0, unit=cfg.unit, start=start)
        stop = stops.enter_context(StopRequest(stuck_after_s=cfg.timeout_s))
        with bar:
            for step in range(start, cfg.steps):
                batch = next(batches, None)
                if batch is None:
                    raise DataError(
                        f"{cfg.data.module_file}:{cfg.data.function} stopped after {step} batches but "
                        f"--steps is {cfg.steps}; make data() yield batches endlessly (e.g. loop over epochs)"
                    )
                heartbeat.beat(step + 1)  # 1-based, as the progress lines count
                stop.step_started()
                if fault is not None:
                    fault.maybe_fire(rank, step + 1, attempt - cfg.first_attempt, cfg.out_dir)
                t0 = time.perf_counter()
                cpu0 = time.process_time()
                try:
                    with trace.step(step), (meter.step(step) if meter is not None else _NO_CONTEXT):
                        if cfg.measure_memory_step == step:
                            with PeakMemory([runner.state, runner.opt.state_dict()["state"], batch]) as pm:
                                loss = runner.step(batch)
                            peak = pm.report
                        else:
                            loss = runner.step(batch)
                    signum = stop.agreed(step + 1)
                except Exception as e:
                    named = named_timeout(e, heartbeat, step + 1, waited_s=time.perf_counter() - t0)
                    if named is e:
                        raise
                    raise named from e
                dt = time.perf_counter() - t0
                cpu_in_steps_s += time.process_time() - cpu0
                ends.append(time.perf_counter())
                losses.append(loss)
                times.append(dt)
                done = step + 1
                periodic = cfg.checkpoint_every is not None and done % cfg.checkpoint_every == 0
                if cfg.checkpoint and (periodic or signum or done == cfg.steps):
                    t_save = time.perf_counter()
                    if pending is not None:  # the previous asynchronous checkpoint: commit it first
                        bar.checkpoint(done, pending.commit(), committed_late=True)
                    asynchronous = cfg.async_checkpoint and not signum and done != cfg.steps
                    pending = _save(cfg, runner, program, device_mesh, rank, world, done, losses,
                                    async_group=async_group if asynchronous else None)
                    path = pending.path
                    if not asynchronous:
                        pending = None
                    checkpoint_times.append(time.perf_counter() - t_save)
                    status.update(step=done)
                    bar.checkpoint(done, path, writing=asynchronous)
                if meter is not None and done == rebalance_at:
                    runner, program = _rebalance(cfg, runner, program, program_dir, meter, range(start + 1, done),
                                                 rank, world, events, trace)
                    meter = None
                bar.update(done, loss, cfg.items_per_step / dt)
                status.note_step(done)  # a rank killed without a word is then named at its last step
                if done == start + 1 and (start or restarted):
                    events.add("resumed_step", step=done, quiet=True)
                if signum and done == cfg.steps:  # every step trained: finish the run (its weights, its result)
                    events.note(f"{signal.Signals(signum).name} after the last step ({done}): finishing the run")
                elif signum:
                    status.update(state="stopped", step=done, error=f"stopped by {signal.Signals(signum).name}")
                    events.add("stopped", step=done, signal=signal.Signals(signum).name,
                               checkpoint=str(path) if cfg.checkpoint else None)
                    raise SystemExit(128 + signum)
        if cfg.checkpoint:
            _write_weights(cfg, runner, rank, device_mesh)
        if cfg.trace:
            trace.save(Path(cfg.out_dir) / "trace" / f"rank{rank}.json")
        dist.barrier()
        status.update(state="finished", step=cfg.steps)
        warm = times[min(2, len(times) - 1):] or times or [float("nan")]
        result = {
            "rank": rank,
            "world_size": world,
            "losses": losses,
            "start_step": start,
            "step_time_s": statistics.median(warm),
            "mean_step_time_s": statistics.fmean(warm),
            "items_per_s": cfg.items_per_step / statistics.median(warm),
            # the mean interval between two step ends after 5 steps (data loading included: the measure of
            # --mode async-hetero's pipeline), and the CPU seconds per step of this process (load-independent)
            "mean_interval_s": ((ends[-1] - ends[min(5, len(ends) - 2)]) / (len(ends) - 1 - min(5, len(ends) - 2))
                                if len(ends) >= 2 else float("nan")),
            "cpu_step_s": cpu_in_steps_s / max(1, len(ends)),
            "checkpoint_s": checkpoint_times,
            "peak_bytes": peak.peak_bytes if peak else None,
            "rss_peak_bytes": peak.rss_peak_bytes if peak else None,
            "events": events.read(),
            "stop_signal": stop.requested,  # a SIGTERM/SIGINT this rank got after its last step began (noted)
            "transports": program_transports(program),
            "shm_all_reduce": _shm_all_reduce_counts(program),
        }
        if rank == 0:  # the launcher's copy (an elastic job's ranks are not its children)
            tmp = Path(cfg.out_dir) / "result.json.tmp"
            tmp.write_text(json.dumps(result))
            tmp.replace(Path(cfg.out_dir) / "result.json")
        return result
    except SystemExit:
        raise
    except BaseException as e:
        status.update(state="failed", step=step, error=f"{type(e).__name__}: {e}"[:2000], error_type=type(e).__name__,
                      # what the other ranks' diagnosis reads (heartbeat.peer_states): whom this rank found dead
                      dead_ranks=list(getattr(e, "dead_ranks", ())), peer_lost=getattr(e, "peer_lost", None))
        raise
    finally:
        stops.close()
        if dist.is_initialized():
            dist.destroy_process_group()


_NO_CONTEXT = contextlib.nullcontext()


def _rebalance(cfg: TrainConfig, runner: StepRunner, program: RankProgram, program_dir: str, meter: Any,
               steps: range, rank: int, world: int, events: "_Events", trace: TraceRecorder
               ) -> tuple[StepRunner, RankProgram]:
    """(Collective) the re-balance after ``steps`` (:mod:`.rebalance`): rank 0 decides from every rank's median
    compute over ``steps`` and lowers the programs with the new rows; every rank moves its state into its new
    program. Returns the runner and program to go on with (the same ones when the rows are kept)."""
    from .rebalance import agree, compute_summary, transfer_state

    own = compute_summary(meter, steps)
    meter.detach()
    step = steps.stop
    decision, path, error = agree(rank, world, own, lambda measured_s, noise: cfg.program_source.rebalance(
        program_dir, cfg.rebalance_cluster, measured_s, noise, step,
        Path(cfg.out_dir) / "programs_rebalanced" / f"step-{step:08d}"))
    if decision is None:
        events.note(f"re-balance after step {step} failed, keeping the rows: {error}")
        return runner, program
    if path is not None:
        new_program = load_program(path, rank, world_size=world)
        old_map = program.plan.devices.rank_to_device if program.plan.devices is not None else None
        new_map = new_program.plan.devices.rank_to_device if new_program.plan.devices is not None else None
        if old_map != new_map or new_program.group_names != program.group_names:  # (the same on every rank)
            events.note(f"re-balance after step {step}: the new programs map ranks differently; keeping the rows")
            path = None
        else:
            new = StepRunner(new_program, cfg.optimizer, cfg.lr, cfg.max_grad_norm, device=runner.device)
            transfer_state(runner, new)
            if cfg.trace:
                new.use_trace(trace)
            runner, program = new, new_program
    events.add("rebalance", **decision.to_doc(), programs=path, quiet=True)
    events.note(decision.line())
    return runner, program


def checkpoint_line(step: int, total: int, path: Path, writing: bool = False, committed_late: bool = False) -> str:
    """The progress log's line for a checkpoint at ``step`` of ``total`` (see ``_Progress.checkpoint``): only a
    committed checkpoint is called one, so that the log never names a checkpoint a restart cannot use."""
    if writing:
        return (f"step {step}/{total}: writing checkpoint {path} in the background (usable once committed, at the "
                "next checkpoint)")
    if committed_late:
        return f"step {step}/{total}: checkpoint {path} committed"
    return f"step {step}/{total}: checkpoint {path}"


class _Written:
    """A checkpoint written into its temporary directory; :meth:`commit` (collective) finishes it: every rank waits
    for its own asynchronous write, a barrier, then rank 0 commits (:mod:`.checkpoint_store`)."""

    def __init__(self, cfg: TrainConfig, rank: int, root: Path, step: int, meta: dict | None, future=None):
        from .checkpoint_store import step_dir

        self.cfg, self.rank, self.root, self.step, self.meta, self.future = cfg, rank, root, step, meta, future
        self.path = step_dir(root, step)

    def commit(self) -> Path:
        from .checkpoint_store import commit, temporary_dir

        if self.future is not None:
            self.future.result()
        dist.barrier()
        if self.rank == 0:
            commit(temporary_dir(self.root, self.step), self.meta, keep=self.cfg.keep)
        dist.barrier()
        return self.path


def _save(cfg: TrainConfig, runner: StepRunner, program: RankProgram, device_mesh, rank: int, world: int,
          step: int, losses: list[float], async_group=None) -> "_Written":
    """Write the checkpoint after ``step`` steps (collective): every rank its shards and RNG state into the
    temporary directory, then rank 0 commits it (:mod:`.checkpoint_store`). With ``async_group`` (a process group
    of :func:`~.train_state.checkpoint_process_group`) the write goes on in a thread and the caller commits the
    returned handle later; else it is committed before this returns."""
    from .checkpoint_store import prepare, temporary_dir
    from .train_state import save_train_state, state_shapes

    root = Path(cfg.out_dir) / "checkpoints"
    if rank == 0:
        prepare(root, step)
    dist.barrier()
    tmp = temporary_dir(root, step)
    meta = None
    if rank == 0:
        meta = {"step": step, "world_size": world, "model": cfg.model_name, "state_shapes": state_shapes(program),
                "losses": list(losses), "plan": json.loads(program.plan.to_json()) if program.plan is not None else None,
                "plan_line": describe_program(program), "data_position": {"step": step}, "seed": cfg.seed,
                **cfg.run_meta}
    future = save_train_state(tmp, program, runner.state, runner.opt, device_mesh, rank,
                              async_=async_group is not None, process_group=async_group)
    written = _Written(cfg, rank, root, step, meta, future)
    if future is None:
        written.commit()
    return written


def _write_weights(cfg: TrainConfig, runner: StepRunner, rank: int, device_mesh) -> None:
    """(Collective) rank 0 writes ``model.safetensors``, the full weights, under a temporary name, then renames it.

    A tensor dim sharded on two mesh axes is described over a mesh in lowering order where that differs from the
    mesh's (:mod:`.checkpoint`; building that mesh is collective).
    """
    from safetensors.torch import save_file

    from ..state_layout import unstack_state
    from .checkpoint import as_global, gather_full, ordered_device_mesh

    out = Path(cfg.out_dir)
    program = runner.program
    from .pipeline_executor import PipelineStepRunner

    if isinstance(runner, PipelineStepRunner):  # a pipeline plan: every rank's tensors gathered on rank 0
        from .pipeline_programs import gather_full_weights

        full = gather_full_weights(program, runner.state)
        if rank == 0:
            full = unstack_state(full, getattr(program, "stacked", {}))
            tmp = out / "model.safetensors.tmp"
            save_file({k: v.detach().cpu().contiguous() for k, v in full.items()}, str(tmp))
            tmp.replace(out / "model.safetensors")
        return
    ordered = ordered_device_mesh(device_mesh, program)
    # the same order on every rank (full_tensor below is collective); runner.state comes in the order of this
    # rank's state.safetensors, which can differ between ranks when shard sizes differ
    names = list(program.input_fqns) + sorted(set(runner.state) - set(program.input_fqns))
    model = {f: as_global(runner.state[f], f, program, device_mesh, ordered) for f in names}
    full = {f: gather_full(t) for f, t in model.items()}  # collective
    full = unstack_state(full, program.stacked)  # ModuleList experts under the user's names (expert_lists.py)
    if rank == 0:
        tmp = out / "model.safetensors.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in full.items()}, str(tmp))
        tmp.replace(out / "model.safetensors")


class _Events:
    """Rank 0's log of restarts, re-plans and resumes: printed as they happen and appended to
    ``OUT/events.jsonl`` (the launcher copies them into summary.json)."""

    def __init__(self, out_dir: str, enabled: bool):
        self.path = Path(out_dir) / "events.jsonl"
        self.enabled = enabled

    def add(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return


        rec = {"event": kind, "time_s": time.time(), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        text = {"restart": lambda: f"restart {fields.get('attempt')}: {fields.get('cause')}",
                "resume": lambda: (f"resumed from {fields.get('checkpoint')} (step {fields.get('step')})\n"
                                   f"adaptdist:   saved by {fields.get('saved_plan')}\n"
                                   f"adaptdist:   now      {fields.get('plan')}"),
                "stopped": lambda: f"stopped by {fields.get('signal')} after step {fields.get('step')}; checkpoint "
                                   f"{fields.get('checkpoint')}"}.get(kind, lambda: kind)()
        if not fields.get("quiet"):
            print(f"adaptdist: {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(f"adaptdist: {text}", file=sys.stderr, flush=True)

    def read(self) -> list[dict]:


        if not self.enabled or not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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
    """A rich progress bar on rank 0 (step, loss, and tok/s or samples/s: ``unit``); off a terminal, a line ``step N/TOTAL`` at least every
    10 steps and at every checkpoint."""

    def __init__(self, total: int, enabled: bool, unit: str = "tokens", start: int = 0):
        self.total, self.enabled, self.start = total, enabled, start
        from ..throughput import short_unit

        self.unit = short_unit(unit)
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
            self._task = self._p.add_task("train", total=self.total, completed=self.start, loss=float("nan"), tps=0.0)
            self._p.__enter__()
        return self

    def update(self, step: int, loss: float, items_per_s: float) -> None:
        if not self.enabled:
            return
        if self._p is not None:
            self._p.update(self._task, completed=step, loss=loss, tps=items_per_s)
        elif step == self.start + 1 or step == self.total or step % 10 == 0 or time.monotonic() - self._last_log > 5:
            self._last_log = time.monotonic()
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {items_per_s:,.0f} {self.unit}/s")

    def checkpoint(self, step: int, path: Path, writing: bool = False, committed_late: bool = False) -> None:
        """A log line (above the bar on a terminal) at ``step``: the checkpoint ``path`` is committed (usable by a
        restart); ``writing``: an asynchronous one was begun, usable only once committed at the next checkpoint;
        ``committed_late``: an asynchronous one begun earlier is committed now."""
        if not self.enabled:
            return
        self.console.print(checkpoint_line(step, self.total, path, writing, committed_late))

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False
