"""The ``adaptdist`` torch.compile backend.

``torch.compile(model, backend="adaptdist")`` (registered through the ``torch_dynamo_backends`` entry
point, so no import is needed) or ``torch.compile(model, backend=adaptdist.backend(cluster=..., plan=...,
constraints=...))``, in a script started by torchrun: each captured graph is

1. captured for all ranks at once (:mod:`.dynamo_capture`: the DDP input contract, each rank passing
   its own inputs),
2. checked to be the same graph on every rank (a rank whose graph differs is refused on every rank,
   naming it: nobody is left waiting in a collective),
3. planned once, on rank 0, and the plan broadcast (or lowered from the given manual plan),
4. lowered into every rank's program (the same passes as ``adaptdist train``), split into forward and
   backward (:mod:`.partition`), and run by :class:`~adaptdist.runtime.compiled_step.CompiledStep`.

Without an initialized process group the world is one rank (the program equals eager). A graph break
splits the forward into several graphs; each is planned alone, its boundary tensors split over the
ranks as the input contract says, and one warning, once the first step has compiled every graph, says
how many breaks there are, where and why.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx

from .. import _torch_compat as compat
from ..errors import (AdaptdistError, CaptureError, CollectiveTimeoutError, PlanMismatchError, RankDivergenceError,
                      UsageError)
from ..lowering_options import LoweringOptions, advice_fitting
from ..mesh import Mesh
from ..placement import parse_placement
from ..plan import Plan, graph_fingerprint
from ..runtime import graph_agreement
from ..runtime.compiled_step import CompiledStep, RankIO, ShardLayout
from ..runtime.rank_input_shapes import input_shapes_text
from ..runtime.sharded_params import install_hooks
from .dynamo_capture import GraphInput, _graph_outputs, capture_all_ranks, check_batch_norm, classify_inputs
from .dynamo_expert_lists import StackedExperts, stack_dynamo_experts
from .failed_compiles import announce_failed_compile
from .expert_lists import fold_stack_of_unbind
from ..runtime.eager_parameters import GraphRuns
from .graphless_calls import guard_eager_module_calls, refuse_skipped_rnn_frame
from .partition import drop_backward_outputs, split_forward_backward

log = logging.getLogger(__name__)


class GraphBreakWarning(UserWarning):
    """The compiled forward was split into several graphs (Dynamo graph breaks)."""


@dataclass(eq=False)  # hashed by identity: torch registers the named backend in a set
class AdaptdistBackend:
    """A configured backend: ``torch.compile(model, backend=AdaptdistBackend(...))``.

    Attributes:
        cluster: an :class:`~adaptdist.cluster.Cluster`, a cluster file path, or None (the local machine
            with the world size's ranks).
        plan: ``"auto"`` (the planner), ``"dp"``, ``"fsdp"``, ``"ep"`` (the ``EP_PLAN`` globs of the compiled module's
            file: stacked experts sharded on their expert dim, tokens moved by all_to_all), ``"dp,tp"``/``"tp"`` (the
            ``TP_PLAN`` globs of that file, else a Hugging Face module's own plan; or pass
            ``ManualPlan.parse("tp", model_module)``), a plan file path (YAML annotations or a saved ``plan.json``),
            or a :class:`~adaptdist.plan.Plan`.
        constraints: the planner's pins and forbidden axes (:class:`~adaptdist.compiler.planner.Constraints`
            or a mapping with ``pins``/``forbid``).
        mesh: a fixed mesh (``"dp=2,tp=2"``) for ``auto`` or a manual plan.
        optimizer: sizes optimizer state in the planner's memory model (``adamw``, ``sgd``, ...).
        bucket_mb: gradient bucket size, MiB (None: :class:`~adaptdist.lowering_options.LoweringOptions`' default,
            as ``adaptdist train``).
        replicate_fallback: ops with no sharding rule gather their inputs and run whole on every rank
            (planned so by ``auto`` too) instead of raising UnsupportedOpError.
        rng: ``"per-rank"`` (DDP's: each rank draws the random numbers of its own inputs from its own generator)
            or ``"global"`` (dropout and other random ops draw what one process draws on all ranks' inputs
            together, whatever the number of ranks; every rank must seed alike, ``torch.manual_seed(s)``, which
            the compile checks; see ``adaptdist/passes/global_rng.py``).
        batch_norm: training-mode BatchNorm: ``"local"`` (DDP's statistics per rank) or ``"sync"``
            (SyncBatchNorm's, over the global batch); see :class:`~adaptdist.lowering_options.LoweringOptions`.
        comm: ``"auto"`` (the default, as the commands': adaptdist's shared-memory collectives on the mesh axes
            whose ranks share a host, where the kernels are loaded on every rank; gloo elsewhere), ``"shm"``
            (required: ShmUnavailableError without them) or ``"gloo"``; see :mod:`adaptdist.comm_transport`. Each
            shared-memory group is named by its ranks, so graphs on different meshes (graph breaks planned apart,
            several models) each use their own.
        compiled: the graphs compiled so far (one per Dynamo graph: several after graph breaks).
    """

    cluster: Any = None
    plan: Any = "auto"
    constraints: Any = None
    mesh: str | None = None
    optimizer: str = "adamw"
    bucket_mb: float | None = None
    replicate_fallback: bool = False
    rng: str = "per-rank"
    batch_norm: str = "local"
    comm: str = "auto"
    compiled: list[CompiledStep] = field(default_factory=list, init=False, repr=False)
    graph_runs: GraphRuns = field(default_factory=GraphRuns, init=False, repr=False, compare=False)
    # a module with trainable parameters that a call compiled by this backend runs eagerly is refused
    # (graphless_calls.refuse_eager_module_call asks the backend of the running call for this)
    refuses_eager_module_calls: ClassVar[bool] = True
    # a compile of this backend that fails before reaching it is announced to the other ranks (failed_compiles)
    announces_failed_compiles: ClassVar[bool] = True

    def __repr__(self) -> str:
        """Only the options set away from their defaults (Dynamo quotes the backend in every compile error), a
        manual plan by its name: ``AdaptdistBackend(plan='fsdp', comm='shm')``."""
        parts = []
        for f in dataclasses.fields(self):
            if not f.repr or getattr(self, f.name) == f.default:
                continue
            v = getattr(self, f.name)
            parts.append(f"{f.name}={getattr(v, 'name', v)!r}" if f.name == "plan" else f"{f.name}={v!r}")
        return f"AdaptdistBackend({', '.join(parts)})"

    def __post_init__(self) -> None:
        """Check every argument now, in the user's script, rather than at the first compiled call.

        Raises:
            UsageError: names the argument, what it got and what it takes.
        """
        compat.on_dynamo_frame_compiled(refuse_skipped_frames)  # before Dynamo sees the model's first frame
        compat.on_dynamo_frame_compiled(refuse_skipped_rnn_frame)
        compat.on_dynamo_frame_compiled(announce_failed_compile)
        compat.on_dynamo_frame_compile_start(guard_eager_module_calls)
        from ..annotations import ManualPlan
        from ..cost_models.memory import OPTIMIZERS
        from .planner import Constraints

        if isinstance(self.cluster, (str, Path)):
            if not Path(self.cluster).is_file():
                raise UsageError(f"adaptdist.backend(cluster={str(self.cluster)!r}): no such file; pass a cluster file "
                                 "(adaptdist cluster detect writes one), a Cluster, or None for the local machine")
        elif self.cluster is not None and not hasattr(self.cluster, "world_size"):
            raise UsageError(f"adaptdist.backend(cluster=...) takes a cluster file path, an adaptdist Cluster or None; "
                             f"got {type(self.cluster).__name__}")
        _refuse_pipeline(self.plan, self.mesh)  # issue 15: pipeline plans run under `adaptdist train` only
        if isinstance(self.plan, str):
            key = self.plan.replace(" ", "")
            if key in ("ep", "tp", "dp,tp"):
                self.plan = key  # the globs of the compiled model's module file (or its own HF plan), found at compile
            elif key != "auto":
                try:
                    self.plan = ManualPlan.parse(self.plan)
                except UsageError as e:
                    raise UsageError(f"adaptdist.backend(plan={self.plan!r}): {e}") from None
        elif not isinstance(self.plan, (Plan, ManualPlan)):
            raise UsageError(f"adaptdist.backend(plan=...) takes 'auto', 'dp', 'fsdp', a plan file path, a ManualPlan "
                             f"or a Plan; got {type(self.plan).__name__}")
        if isinstance(self.constraints, Mapping):
            unknown = set(self.constraints) - {"pins", "forbid"}
            pins, forbid = self.constraints.get("pins", {}), self.constraints.get("forbid", {})
            if unknown or not isinstance(pins, Mapping) or not isinstance(forbid, Mapping):
                raise UsageError("adaptdist.backend(constraints=...) takes {'pins': {param glob: {axis: placement}}, "
                                 f"'forbid': {{param glob: [axis, ...]}}}}; got {dict(self.constraints)!r}")
            self.constraints = Constraints(pins=pins, forbid=forbid)
        elif self.constraints is not None and not isinstance(self.constraints, Constraints):
            raise UsageError(f"adaptdist.backend(constraints=...) takes a mapping with 'pins'/'forbid' or a Constraints; "
                             f"got {type(self.constraints).__name__}")
        if self.mesh is not None:
            if not isinstance(self.mesh, str):
                raise UsageError(f"adaptdist.backend(mesh=...) takes text like 'dp=2,tp=2'; got {self.mesh!r}")
            Mesh.parse(self.mesh)
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"adaptdist.backend(optimizer={self.optimizer!r}): not one of {', '.join(OPTIMIZERS)}")
        if self.bucket_mb is not None and (isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float))
                                           or not self.bucket_mb > 0):
            raise UsageError(f"adaptdist.backend(bucket_mb={self.bucket_mb!r}) takes a number of MiB > 0, or None "
                             "for the default")
        if not isinstance(self.replicate_fallback, bool):
            raise UsageError(f"adaptdist.backend(replicate_fallback={self.replicate_fallback!r}) takes True or False")
        from ..lowering_options import BATCH_NORM_MODES, RNG_MODES

        if self.rng not in RNG_MODES:
            raise UsageError(f"adaptdist.backend(rng={self.rng!r}) takes one of {', '.join(map(repr, RNG_MODES))}")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise UsageError(f"adaptdist.backend(batch_norm={self.batch_norm!r}) takes 'local' (each rank's statistics, "
                             "as DDP) or 'sync' (over the global batch, as SyncBatchNorm)")
        from ..comm_transport import COMM_MODES

        if self.comm not in COMM_MODES:
            raise UsageError(f"adaptdist.backend(comm={self.comm!r}) takes one of {', '.join(map(repr, COMM_MODES))}")
        if self.comm == "shm":
            from ..kernels import require

            require("adaptdist.backend(comm='shm')")

    def lowering_options(self, hosts: tuple[str, ...] | None = None, comm: str | None = None,
                         shm_space: tuple[int, int] | None = None) -> LoweringOptions:
        """The :class:`~adaptdist.lowering_options.LoweringOptions` of these arguments; ``hosts``: each rank's host
        (:func:`_rank_hosts`), ``comm``: overrides :attr:`comm` (gloo where a rank lacks the kernels),
        ``shm_space``: /dev/shm's (size, free) bytes every rank agreed on."""
        return LoweringOptions.from_mb(self.bucket_mb, replicate_fallback=self.replicate_fallback, front_end="backend",
                                       rng=self.rng, batch_norm=self.batch_norm, comm=comm or self.comm, hosts=hosts,
                                       shm_space=shm_space)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with advice_fitting("backend"):  # errors advise this backend's arguments, not the command's flags
            step = compile_graph(gm, example_inputs, self)
        if isinstance(step, CompiledStep):  # not a graph run as it is (compile_graph)
            step.runs = self.graph_runs
            self.compiled.append(step)
        return step


def _refuse_pipeline(plan: Any, mesh: Any) -> None:
    """Pipeline plans (``plan="pp"``, a mesh with a ``pp`` axis, a saved pipeline plan) are not supported here.

    Raises:
        UsageError: says why and what to use instead.
    """
    if isinstance(plan, str) and plan.endswith(".json") and Path(plan).is_file():
        try:
            plan = Plan.load(plan)
        except Exception:  # noqa: BLE001 -- a bad file is reported by the normal path below
            return
    named = (isinstance(plan, str) and plan.replace(" ", "") == "pp") or getattr(plan, "pipeline", None) is not None
    axes = [part.split("=")[0].strip() for part in mesh.split(",")] if isinstance(mesh, str) else []
    if named or "pp" in axes:
        what = f"mesh={mesh!r}" if "pp" in axes and not named else "a pipeline plan"
        raise UsageError(f"adaptdist.backend({what}): the torch.compile backend does not run pipeline plans (a "
                         "compiled graph is one program per rank per call; a pipeline step runs several stage "
                         "programs per rank, microbatch by microbatch, with sends and receives between the ranks "
                         "in the schedule's order); train a pipeline with `adaptdist train --plan pp` (or --mesh pp=2,dp=2), or "
                         "`adaptdist compile` + `adaptdist run`, and use dp, fsdp or tp with the backend")


def backend(cluster: Any = None, plan: Any = "auto", constraints: Any = None, mesh: str | None = None,
            optimizer: str = "adamw", bucket_mb: float | None = None, replicate_fallback: bool = False,
            rng: str = "per-rank", batch_norm: str = "local", comm: str = "auto") -> AdaptdistBackend:
    """A configured ``adaptdist`` backend for ``torch.compile`` (arguments: see :class:`AdaptdistBackend`).

    Raises:
        UsageError: a bad argument, named with what it takes (a missing cluster file, an unknown plan
            preset, a malformed mesh or constraints, an unknown optimizer, a bucket size not > 0, an rng mode
            not ``"per-rank"`` or ``"global"``, a batch_norm other than 'local' / 'sync').
    """
    return AdaptdistBackend(cluster=cluster, plan=plan, constraints=constraints, mesh=mesh, optimizer=optimizer,
                            bucket_mb=bucket_mb, replicate_fallback=replicate_fallback, rng=rng,
                            batch_norm=batch_norm, comm=comm)


def adaptdist_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledStep:
    """``backend="adaptdist"``: the automatic plan on the local cluster of the world size."""
    return compile_graph(gm, example_inputs, AdaptdistBackend())


adaptdist_backend.announces_failed_compiles = True  # type: ignore[attr-defined]  # as AdaptdistBackend's


def __getattr__(name: str) -> Any:
    """``named_backend``, the ``torch_dynamo_backends`` entry point (pyproject.toml): :func:`adaptdist_backend`,
    with :func:`refuse_skipped_frames` installed as torch resolves ``backend="adaptdist"`` (at ``torch.compile``),
    before Dynamo compiles, or skips, the model's first frame."""
    if name == "named_backend":  # loaded once per process by torch (cached): one backend, one graph-run count
        return AdaptdistBackend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def refuse_skipped_frames(_args: Any = None) -> None:
    """Dynamo callback, at the end of every frame compile: in a job of several ranks, a frame Dynamo skipped
    (a graph break inside a for/while loop, which it cannot resume) runs eagerly on every rank, never reaching
    this backend, so the gradients of the parameters it uses would never be reduced across ranks: every
    rank's model would drift apart silently. Stop instead, on every rank alike (each skips the same frame).
    With one rank, eager is the single-process step: nothing to refuse.

    Raises:
        CaptureError: names the skipped frame (file, line), the graph break and what to try.
    """
    skipped = compat.new_skipped_frames()
    if not skipped or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    text = skipped[0]
    frame = re.search(r"frame skipped: ([^\n]*)", text)
    cause = text.strip().split("\n")[0]
    if "Dynamic shape operator" in text:
        from .capture import data_dependent_message

        advice = data_dependent_message("The model", f"(Dynamo: {cause})")
    elif frame and _in_installed_package(frame.group(1)):  # a library's loop (transformers' hooks): not the user's
        advice = (f"Dynamo's reason: {cause}. That loop is in an installed package, not in your code: train this model "
                  "with adaptdist train (it captures forward and backward in one graph without Dynamo), or ask the "
                  "package to avoid the graph break")
    else:
        advice = (f"Dynamo's reason: {cause}. Remove that graph break from the loop (see TORCH_LOGS=graph_breaks), "
                  "or train with adaptdist train, which captures one graph or says what stops it")
    compat.raise_at_frame_compile_end(CaptureError(
        f"torch.compile skipped {frame.group(1) if frame else 'a frame'} and runs it eagerly, uncompiled: a graph "
        f"break inside a for/while loop. On {dist.get_world_size()} ranks the gradients of the parameters it uses "
        f"would never be reduced across ranks (each rank would train its own model), so adaptdist stops. {advice}"))


def _in_installed_package(frame_text: str) -> bool:
    """Whether Dynamo's ``name (FILE line N)`` of a skipped frame names a file of an installed package
    (site-packages/dist-packages), not the user's code."""
    return any(f"{os.sep}{d}{os.sep}" in frame_text for d in ("site-packages", "dist-packages"))


def destroy_process_groups_at_exit() -> None:
    """At interpreter exit (registered by the first compile in a process with torch.distributed initialized):
    destroy the process groups if the script left them initialized, so gloo's worker threads stop before
    Python finalizes. A script that never calls ``dist.destroy_process_group()`` otherwise aborts now and
    then after finishing: a gloo thread that releases a finished work's tensors needs the GIL during
    finalization, and Python ends it from under C++ code ("terminate called without an active exception",
    SIGABRT; plain DDP under torchrun does it too). Destroying gloo groups is local: no rank waits."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # at exit, nothing is left to tell: log it, do not mask the script's status
            log.debug("adaptdist: destroy_process_group at exit failed: %s", e)


# --- control messages between ranks (gloo, CPU tensors) --------------------------------------------

def _control_group() -> Any:
    """The group control messages travel in: the world if it runs gloo, else a new gloo group of all ranks
    (messages are CPU tensors). A collective: every rank calls it."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _all_gather_text(text: str, group: Any) -> list[str]:
    """Every rank's ``text`` (a collective: every rank calls it)."""
    return graph_agreement.all_gather_text(text, group)


def _rank_hosts(comm: str, rank: int, group: Any
                ) -> tuple[tuple[str, ...] | None, str | None, tuple[int, int] | None]:
    """(Collective over ``group``) each rank's host name, the comm mode the lowering takes: ``comm``, or gloo
    under ``auto`` when some rank cannot load the kernels (every rank must lower alike) or the world's backend is
    not gloo; and rank 0's reading of /dev/shm's (size, free) bytes, which every rank's lowering fits its
    shared-memory groups into (read by each rank at its own moment, a rank lowering after its peers made their
    groups would see less room and put an axis on gloo while they put it on shm: a hang).
    ``(None, None, None)`` under ``gloo``."""
    if comm == "gloo":
        return None, None, None
    if comm == "auto" and dist.get_backend() != "gloo":  # the kernels move CPU tensors: nccl's stay on nccl
        return None, "gloo", None
    import socket

    from ..kernels import available
    from ..kernels.shm import shm_space

    space = shm_space() or (-1, -1)
    texts = _agree("finding the ranks' hosts", f"{int(available())} {space[0]} {space[1]} {socket.gethostname()}",
                   rank, group)
    fields = [t.split(" ", 3) for t in texts]
    hosts = tuple((f[3] if len(f) > 3 else "") or "?" for f in fields)
    size, free = (int(fields[0][1]), int(fields[0][2])) if len(fields[0]) > 3 else (-1, -1)
    agreed = (size, free) if size >= 0 else None
    if comm == "auto" and not all(f[0] == "1" for f in fields):
        return hosts, "gloo", agreed
    return hosts, comm, agreed


def _agree(what: str, value_or_error: str, rank: int, group: Any) -> list[str]:
    """Exchange one line per rank; if any rank reports ``error: ...``, raise it on every rank."""
    texts = _all_gather_text(value_or_error, group)
    failed = [(r, t) for r, t in enumerate(texts) if t.startswith("error: ")]
    if failed:
        r, t = failed[0]
        cls, text = _error_type(t.removeprefix("error: "))
        raise cls(f"{what} failed on rank {r}: {text}"
                  + ("" if r == rank else " (this rank stopped with it, so no rank waits)"))
    return texts


def _error_type(text: str) -> tuple[type[AdaptdistError], str]:
    """``"CaptureError: msg"`` -> (CaptureError, ``"msg"``): an adaptdist error told by another rank is raised on
    every rank as its own type (so ``except CaptureError`` catches it), other types as AdaptdistError with the
    type's name kept in the text."""
    from .. import errors

    name, sep, rest = text.partition(": ")
    cls = getattr(errors, name, None) if sep and name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, AdaptdistError):
        try:
            cls(rest)  # (a type whose constructor takes more than the message stays AdaptdistError)
        except TypeError:
            return AdaptdistError, text
        return cls, rest
    return AdaptdistError, text


# --- the compile -----------------------------------------------------------------------------------

def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: AdaptdistBackend
                  ) -> CompiledStep | torch.fx.GraphModule:
    """Compile one Dynamo graph for this rank (module docstring).

    A graph with nothing to split (:func:`_runs_as_is`: no floating-point output or no input that requires
    grad, and no parameter held as a shard) is returned as it is, run eagerly on this rank's own inputs.

    Raises:
        CaptureError: the graph cannot be captured for all ranks (names the construct).
        PlanMismatchError: ranks captured different graphs (names the ranks and their fingerprints).
        PlanInfeasibleError, UsageError, UnsupportedOpError: from the planner or the lowering, raised
            on every rank.
    """
    t0 = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if distributed:  # so that destroy_process_group() frees the groups (its docstring says why)
        compat.release_import_time_default_groups()
        # once per process: unregister drops an earlier registration of the same function
        atexit.unregister(destroy_process_groups_at_exit)
        atexit.register(destroy_process_groups_at_exit)
    _note_graph_breaks(gm)
    inputs, captured, tangent_outputs, error, as_is = [], None, [], "", False
    cap_inputs, experts = [], StackedExperts()
    frame = compat.dynamo_frame()
    # the frame as every rank names it (not its file: paths may differ between hosts)
    frame_key = f"{frame[0]}:{frame[2]}" if frame else ""
    announced, control, signature = False, None, ""
    try:
        inputs = classify_inputs(gm, example_inputs)
        check_batch_norm(gm, config.batch_norm)
        as_is = _runs_as_is(gm, inputs)
        if distributed and not as_is:  # before any collective of this compile (graph_agreement says why)
            _announce_compile(gm, inputs, frame)
            announced = True
        if not as_is:
            # ModuleList experts: one stacked [E, ...] input per parameter name (issue 14, ep)
            cap_gm, cap_inputs, experts = stack_dynamo_experts(gm, inputs)
            try:
                with torch.enable_grad():  # an eval loop's no_grad(): the program still has its backward part
                    captured, tangent_outputs = capture_all_ranks(cap_gm, cap_inputs, world, config.batch_norm,
                                                                      config.rng)
            except Exception as e:
                if not experts.stacked:
                    raise
                # batching the experts failed: capture them as they are (every rank holds every expert)
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                prefixes = sorted({f.split(".*.")[0] for f in experts.stacked})
                experts = StackedExperts(notes=experts.notes + [
                    f"{p} is not sharded as experts: running them batched failed ({why})" for p in prefixes])
                cap_inputs = inputs
                with torch.enable_grad():
                    captured, tangent_outputs = capture_all_ranks(gm, inputs, world, config.batch_norm,
                                                                      config.rng)
            if experts.stacked:
                captured.stacked, captured.notes = experts.stacked, experts.notes
                fold_stack_of_unbind(captured.gm)
            for note in experts.notes:
                log.info("adaptdist: %s", note)
            if captured.unused_param_fqns and rank == 0:
                from .capture import unused_params_line

                log.warning("adaptdist: %s", unused_params_line(f"the compiled graph at {frame_key or '?'}",
                                                                captured.unused_param_fqns, "its outputs"))
    except (RankDivergenceError, CollectiveTimeoutError):  # raised on every rank already
        raise
    except Exception as e:  # every failure is told to every rank, so none waits in a collective
        hint = _data_dependent_hint()
        if not distributed:
            if hint:
                raise CaptureError(_cause_first(hint, e)) from e
            raise
        error = f"error: CaptureError: {_cause_first(hint, e)}" if hint else f"error: {type(e).__name__}: {e}"
    if as_is and not error:
        # nothing crosses ranks (DDP's per-rank computation): no agreement, so ranks may differ here as under DDP;
        # a rank that captured a graph instead announces it, and this rank's next compiled graph meets that
        log.debug("adaptdist: a compiled graph with nothing to split runs as it is on each rank")
        return gm
    if distributed:
        if not announced:
            _announce_compile(gm, inputs, frame)
        control = _control_group()
        signature = error or _signature(captured, inputs)
        texts = _agree("capturing the compiled graph", signature, rank, control)
        if len(set(texts)) > 1:
            groups: dict[str, list[int]] = {}
            for r, text in enumerate(texts):
                groups.setdefault(text, []).append(r)
            shapes_hint = _input_shapes_hint(inputs, control)  # a collective: on every rank, before any `or`
            raise PlanMismatchError(
                "the ranks compiled different graphs (" + "; ".join(
                    f"ranks {rs}: graph {text.split(' ')[0][:12]}, inputs {text.partition(' ')[2]}"
                    for text, rs in groups.items())
                + "); every rank must run the same model on inputs of the same shapes and dtypes"
                + (_data_dependent_hint() or shapes_hint or _divergent_branch_hint()))
    if distributed and config.rng == "global":
        _check_same_rng_state(rank, control)
    plan = _plan(captured, inputs, config, world, rank, control)
    from .lowering import lower, resolve_plan

    hosts, comm, shm_space = _rank_hosts(config.comm, rank, control) if distributed else (None, None, None)
    programs = lower(captured, resolve_plan(plan, captured, world, config.mesh if not isinstance(plan, Plan) else None),
                     config.lowering_options(hosts, comm, shm_space))
    program = programs[rank]
    io = _rank_io(programs, rank, world)
    step_layouts, expert_rows = _member_layouts(_layouts(program, programs, cap_inputs), experts, inputs, rank)
    sharded = {inputs[k].source for k in step_layouts if inputs[k].kind == "param"}
    # parameters hold their shards from the first call on (adaptdist.runtime.sharded_params): the module's
    # hooks (installed once, whatever this graph's plan: a later graph after a break may shard) and no size
    # guards on the sharded ones
    root = compat.dynamo_root_module()
    if root is None and not compat.dynamo_frame_is_resume():
        # the frame is not a module's method, but the torch.compile'd module's call may still be what runs it:
        # a forward under decorators (Hugging Face's wrapped_func(*args, **kwargs)) is compiled as the
        # decorator's frame; the module's own hooks run eagerly before it (OptimizedModule calls
        # module.__call__, whose hook-running code Dynamo skips), so they do the swaps
        wrapper = compat.dynamo_compiled_wrapper()
        root = wrapper._orig_mod if wrapper is not None else None
    if root is not None:  # a torch.nn module (nn.Sequential) is compiled inside a frame that traces its hooks
        install_hooks(root, compat.dynamo_compiled_wrapper(root) if compat.dynamo_root_is_wrapped() else None)
    if sharded:
        compat.drop_tensor_guards(sharded)
        if root is None and not compat.dynamo_frame_is_resume():
            log.warning("adaptdist: the compiled code is not a module's forward: its parameters are sharded, but a "
                        "recompile (no_grad, a new input shape) would trace their shards; compile the module")
    groups = {}
    if distributed:
        from ..runtime.worker import register_mesh_groups

        register_mesh_groups(program, dist.get_backend())
        # by torch's group name, not the group object (CompiledStep.process_groups says why)
        groups = {name: compat.resolve_process_group(name).group_name for name in program.group_names.values()}
    split = split_forward_backward(program.graph_module, ("out:", "buffer:"))  # buffers: updated by the forward
    split = drop_backward_outputs(split, ("loss",))  # the capture's sum <out, tangent>: never read (dp: an all_reduce)
    step = _compiled_step(split, program, step_layouts, inputs, tangent_outputs, io, world, rank, cap_inputs, experts,
                          expert_rows)
    step.process_groups = groups
    step.graph_id = graph_agreement.graph_id(f"{signature}|{frame_key}") if distributed else 0
    step.description = _graph_text(signature, frame, gm)
    step.input_shapes = input_shapes_text(inputs)
    step.root_module = weakref.ref(root) if root is not None else None
    if not compat.dynamo_frame_is_resume():  # the step's first graph: the others are compiled by its end
        step.after_first_step = report_graph_breaks
    if rank == 0:
        _log_compiled(programs, config, world, time.perf_counter() - t0)
    return step


def _frame_text(frame: tuple[str, str, int] | None) -> str:
    return f"frame {frame[0]} ({frame[1]}:{frame[2]})" if frame else "a frame"


def _user_lines(gm: torch.fx.GraphModule) -> str:
    """The user code a Dynamo graph holds, as ``file:first-last`` of its nodes' stack traces ("" if none)."""
    sites = [(m.group(1), int(m.group(2))) for n in gm.graph.nodes if n.meta.get("stack_trace")
             for m in [list(_FRAME.finditer(n.meta["stack_trace"]))[-1]]]
    if not sites:
        return ""
    lines = [line for f, line in sites if f == sites[0][0]]
    return f"{sites[0][0]}:{min(lines)}" + (f"-{max(lines)}" if max(lines) != min(lines) else "")


def _announce_compile(gm: torch.fx.GraphModule, inputs: list[GraphInput], frame: tuple[str, str, int] | None) -> None:
    """Tell the other ranks this rank compiles a graph (:func:`graph_agreement.announce`): they must be
    compiling too, else every rank stops with a RankDivergenceError naming this frame, Dynamo's reason to
    recompile it and the graph's code lines."""
    def describe() -> str:
        reason = compat.dynamo_recompile_reason()
        lines = _user_lines(gm)
        return graph_agreement.unit_text(
            graph_agreement.COMPILE,
            _frame_text(frame) + (f", code {lines}" if lines else "") + f", inputs [{_input_shapes(inputs)}]"
            + (f" (Dynamo compiles this frame again: {reason})" if reason else _first_graph_text(frame)))
    try:
        graph_agreement.announce(graph_agreement.COMPILE, 0, describe, lambda: input_shapes_text(inputs))
    except (RankDivergenceError, CollectiveTimeoutError) as e:
        # the user sees the typed error, as on the rank whose compile failed, not Dynamo's BackendCompilerFailed
        raise compat.through_dynamo(e) from e.__cause__


def _first_graph_text(frame: tuple[str, str, int] | None) -> str:
    """Why a frame compiled for the first time on one rank may be new to it: a resume function is the code after
    a graph break, reached by this rank only when the break is a branch it took differently."""
    m = re.match(r"torch_dynamo_resume_in_(.+)_at_(\d+)$", frame[0]) if frame else None
    if m:
        return (f" (the frame's first graph: the code of {m.group(1)} after its graph break at line {m.group(2)}, "
                "which this rank reaches for the first time)")
    return " (the frame's first graph)"


def _graph_text(signature: str, frame: tuple[str, str, int] | None, gm: torch.fx.GraphModule) -> str:
    """A compiled graph in words, for a RankDivergenceError: its fingerprint, frame and code lines."""
    lines = _user_lines(gm)
    inputs = signature.partition(" ")[2]
    return (f"graph {signature[:12] or '(one rank)'} compiled earlier for {_frame_text(frame)}"
            + (f", code {lines}" if lines else "") + (f", inputs {inputs}" if inputs else ""))


def _log_compiled(programs: Mapping[int, Any], config: AdaptdistBackend, world: int, compile_s: float) -> None:
    """One INFO line on what was compiled (as ``adaptdist train`` prints it): the plan, its mesh, the cost
    model's predicted step time and peak memory per rank, and the compile time. A prediction that fails
    (a cluster file of other ranks, an op without a cost) is named in the line instead."""
    from ..cost_models.estimate import estimate_programs

    program = programs[0]
    mesh = ",".join(f"{a}={n}" for a, n in program.mesh.items())
    name = program.plan.name if program.plan is not None else "unnamed"
    try:
        est = estimate_programs(programs, _cluster_of(config, world), config.optimizer)
        predicted = (f"predicted step {1e3 * est.step_s:.3g} ms and peak memory "
                     f"{est.peak_memory_bytes / 2**20:.3g} MiB per rank")
    except Exception as e:  # the line is informative only: the compile has succeeded
        predicted = f"no prediction ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    log.info("adaptdist: compiled graph with plan %r on mesh %s (%d ranks): %s; compiled in %.1f s", name, mesh,
             world, predicted, compile_s)


def _plan(captured: Any, inputs: list[GraphInput], config: AdaptdistBackend, world: int, rank: int,
          control: Any) -> Any:
    """The plan every rank lowers: a manual plan as given; ``auto``: rank 0's planner result, broadcast;
    for a graph whose parameters an earlier graph already sharded, that graph's mesh and placements."""
    from ..annotations import ManualPlan

    earlier = [i.layout for i in inputs if i.layout is not None]
    if earlier:
        return _plan_of_sharded(captured, earlier)
    if config.plan in ("ep", "tp", "dp,tp"):
        return _model_plan(config.plan)
    if isinstance(config.plan, (Plan, ManualPlan)):
        return config.plan  # checked by AdaptdistBackend.__post_init__: otherwise "auto"
    distributed = dist.is_available() and dist.is_initialized()
    text = ""
    if rank == 0:
        try:
            text = _auto_plan(captured, config, world).to_json()
        except Exception as e:  # told to every rank, so none waits in the broadcast
            if not distributed:
                raise
            text = f"error: {type(e).__name__}: {e}"
    if distributed:
        text = _agree("planning", text, rank, control)[0]
    return Plan.from_json(text, "the automatic plan")  # rank 0 logs it with the compiled graph


def _model_plan(key: str) -> Any:
    """``plan="ep"``: the ``ep`` preset with the ``EP_PLAN`` globs of the file defining the compiled module's class
    (``adaptdist/models/moe.py``'s for its MoEModel), as ``adaptdist train --plan ep`` reads the model file's;
    ``"tp"``/``"dp,tp"``: that file's ``TP_PLAN``, else the compiled module's own Hugging Face plan
    (:func:`adaptdist.hf_tp_plan.hf_tp_plan`).

    Raises:
        UsageError: the compiled code is not a module's forward, or neither its file nor the module gives the
            plan's globs (says what to pass).
    """
    import sys

    from ..annotations import ManualPlan

    root = compat.dynamo_root_module()
    if root is None:
        wrapper = compat.dynamo_compiled_wrapper()
        root = wrapper._orig_mod if wrapper is not None else None
    module = sys.modules.get(type(root).__module__) if root is not None else None
    globs = "EP_PLAN" if key == "ep" else "TP_PLAN"
    if module is None:
        raise UsageError(f"adaptdist.backend(plan={key!r}) reads {globs} from the file of the compiled module's class, "
                         f"and the compiled code is not a module's forward: pass plan=ManualPlan.parse({key!r}, "
                         "model_module)")
    try:
        return ManualPlan.parse(key, module, root)
    except UsageError as e:
        raise UsageError(f"adaptdist.backend(plan={key!r}) on {type(root).__name__} ({module.__name__}): {e}; or pass "
                         f"plan=ManualPlan.parse({key!r}, model_module)") from None


def _check_same_rng_state(rank: int, control: Any) -> None:
    """Under ``rng="global"``: every rank's CPU generator state must be the same (a collective).

    Raises:
        UsageError: on every rank, naming the ranks whose state differs from rank 0's.
    """
    import hashlib

    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    texts = _agree("checking the random generator state", digest, rank, control)
    differ = [r for r, t in enumerate(texts) if t != texts[0]]
    if differ:
        raise UsageError(f"adaptdist.backend(rng='global') needs the same random generator state on every rank, and "
                         f"ranks {differ} differ from rank 0: call torch.manual_seed(s) with the same s on every rank "
                         "before the first step (not seed + rank), or use rng='per-rank'")


def _input_shapes(inputs: list[GraphInput]) -> str:
    return ", ".join(f"{i.fqn} {str(i.dtype).removeprefix('torch.')}{list(i.global_shape)}"
                     for i in inputs if i.kind == "input")


def _signature(captured: Any, inputs: list[GraphInput]) -> str:
    """What ranks must agree on: the captured graph's fingerprint, then the user inputs' shapes and dtypes."""
    return f"{graph_fingerprint(captured.gm)} [{_input_shapes(inputs)}]"


def _runs_as_is(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> bool:
    """Whether a Dynamo graph has nothing the backend would split, so it runs as it is on each rank.

    That is a graph with no floating-point output or no input that requires grad (the loss graph after a
    graph break evaluated under ``no_grad()``: integer labels and logits that do not require grad; a graph of
    integer masks), and no parameter held as a shard (an earlier graph's plan sharded it: the graph would
    read the placeholder in its place). Under the DDP contract each rank runs the step on its own inputs
    with replicated parameters, and no gradient of such a graph reaches a parameter, so nothing would cross
    ranks: running the graph unchanged on this rank's inputs is exactly what DDP computes, and a gradient
    it passes back to an input reaches the earlier graph through autograd as usual."""
    if any(i.layout is not None for i in inputs):
        return False
    floating = [o for o in _graph_outputs(gm) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return not floating or not any(i.requires_grad for i in inputs)


def _plan_of_sharded(captured: Any, layouts: list[ShardLayout]) -> Plan:
    """A plan keeping the layout of parameters sharded by an earlier compiled graph (the same code at
    another input shape, or a parameter used on both sides of a graph break): its mesh, batch axis and
    parameter placements; other parameters replicated.

    Raises:
        UsageError: the layouts come from plans on different meshes.
    """
    first = Plan.from_json(layouts[0].plan_json, "the plan of an earlier compiled graph")
    for layout in layouts[1:]:
        other = Plan.from_json(layout.plan_json, "the plan of an earlier compiled graph")
        if dict(other.mesh) != dict(first.mesh) or other.batch_axis != first.batch_axis:
            raise UsageError(f"parameters of this graph were sharded by plans on different meshes ({dict(first.mesh)} "
                             f"and {dict(other.mesh)}, parameter {layout.fqn}); compile the model with one backend")
    placements = {l.fqn: tuple(parse_placement(l.placements[a]) for a in first.mesh) for l in layouts}
    return Plan(mesh=dict(first.mesh), batch_axis=first.batch_axis, param_placements=placements,
                graph_fingerprint=graph_fingerprint(captured.gm), name=f"{first.name} (parameters already sharded)")


def _cluster_of(config: AdaptdistBackend, world: int) -> Any:
    """The backend's cluster: ``config.cluster`` (a Cluster, or a file loaded), else this machine's ``world`` ranks."""
    from ..calibrate.local import load_cluster, local_cluster

    if config.cluster is None:
        return local_cluster(world)
    if isinstance(config.cluster, (str, Path)):
        return load_cluster(config.cluster)
    return config.cluster


def _auto_plan(captured: Any, config: AdaptdistBackend, world: int) -> Plan:
    from .planner import plan_auto

    from ..comm_transport import cluster_for_comm

    cluster = cluster_for_comm(_cluster_of(config, world), config.comm)  # priced as the lowering will carry it
    if cluster.world_size != world:
        raise UsageError(f"the cluster has {cluster.world_size} ranks but this job has {world}; pass a cluster of "
                         f"{world} devices (or none: the local machine)")
    mesh = Mesh.parse(config.mesh) if config.mesh else None
    return plan_auto(captured, cluster, mesh=mesh, constraints=config.constraints, optimizer=config.optimizer,
                     replicate_fallback=config.replicate_fallback).plan


def _rank_io(programs: Mapping[int, Any], rank: int, world: int) -> RankIO:
    """Which ranks' inputs this rank's program reads: the rows ``batch_slice`` of the stacked inputs must
    be the inputs of a group of whole ranks, the same group for each of them (true when the batch axis is
    the outermost mesh axis, as the planner and the presets make it)."""
    slices = {r: tuple(p.batch_slice) for r, p in programs.items()}
    for r, (off, size) in slices.items():
        members = range(off, off + size)
        if r not in members or any(slices[m] != (off, size) for m in members):
            raise UsageError(f"rank {r} reads the inputs of ranks {list(members)} under this plan's mesh "
                             f"{programs[r].mesh}; the adaptdist backend needs the batch axis outermost "
                             "(list it first in --mesh / the plan file)")
    groups: dict[tuple[int, int], Any] = {}
    for off, size in sorted(set(slices.values())):
        # every rank creates every group, in the same order (torch's rule for new_group)
        groups[(off, size)] = (dist.new_group(list(range(off, off + size))) if 1 < size < world else
                               dist.group.WORLD if size == world > 1 else None)
    off, size = slices[rank]
    group = groups[(off, size)]
    return RankIO(off, size, rank - off, None if group is None else group.group_name)


def _layouts(program: Any, programs: Mapping[int, Any], inputs: list[GraphInput]) -> dict[int, ShardLayout]:
    """The layout of every state input the plan shards, by Dynamo input index (with the plan, so a later
    graph that meets an already sharded parameter keeps its layout)."""
    from ..state_layout import shard_layout

    index_of = {i.fqn: k for k, i in enumerate(inputs) if i.kind != "input"}
    if not program.state_placements:
        return {}
    by_rank = {r: shard_layout(p) for r, p in programs.items()}
    plan_json = program.plan.to_json() if program.plan is not None else ""
    out = {}
    for f, pls in program.state_placements.items():
        if f not in index_of:
            continue
        k = index_of[f]
        ranges = [by_rank[r][f]["ranges"] for r in sorted(by_rank)]
        earlier = inputs[k].layout
        if earlier is not None and earlier.ranges != ranges:
            raise AdaptdistError(f"parameter {f} was sharded as {earlier.ranges} by an earlier graph, and this "
                                 f"graph's plan puts it at {ranges}")
        out[k] = earlier or ShardLayout(f, tuple(inputs[k].global_shape), dict(zip(program.mesh, pls)), ranges,
                                        plan_json)
    return out


def _member_layouts(layouts: dict[int, ShardLayout], experts: StackedExperts, inputs: list[GraphInput], rank: int
                    ) -> tuple[dict[int, ShardLayout], dict[tuple[int, ...], tuple[list[bool], tuple[int, ...]]]]:
    """Layouts by captured input index -> by Dynamo input index: a stacked experts' layout becomes one per member
    (expert e's shard on rank r: its rows of the stacked value's other dims where r holds e, empty elsewhere), so
    each rank's parameter objects hold only its experts; and per stacked input, which members this rank holds and
    the shape of its stacked value."""
    if not experts.origin:
        return layouts, {}
    out: dict[int, ShardLayout] = {}
    rows: dict[tuple[int, ...], tuple[list[bool], tuple[int, ...]]] = {}
    for j, o in enumerate(experts.origin):
        lay = layouts.get(j)
        if not isinstance(o, list):
            if lay is not None:
                out[o] = lay
            continue
        shape = tuple(inputs[o[0]].global_shape)
        if lay is None:
            rows[tuple(o)] = ([True] * len(o), (len(o), *shape))
            continue
        mine = lay.ranges[rank]
        rows[tuple(o)] = ([mine[0][0] <= e < mine[0][1] for e in range(len(o))], tuple(hi - lo for lo, hi in mine))
        pls = {a: ("R" if p == "S(0)" else f"S({int(p[2:-1]) - 1})" if p.startswith("S(") else p)
               for a, p in lay.placements.items()}
        for e, k in enumerate(o):
            ranges = [r[1:] if r[0][0] <= e < r[0][1] else [[0, 0]] + r[2:] for r in lay.ranges]
            whole = all(all(hi - lo == n for (lo, hi), n in zip(r, shape)) or r[0][1] == r[0][0] for r in ranges)
            out[k] = ShardLayout(inputs[k].fqn, shape, pls, ranges, lay.plan_json, whole_or_none=whole)
    return out, rows


def _compiled_step(split: Any, program: Any, layouts: dict[int, ShardLayout], inputs: list[GraphInput],
                   tangent_outputs: list[int], io: RankIO, world: int, rank: int,
                   cap_inputs: list[GraphInput] | None = None, experts: StackedExperts | None = None,
                   expert_rows: dict | None = None) -> CompiledStep:
    """``inputs``: the Dynamo graph's; ``cap_inputs``: the captured graph's (ModuleList experts stacked,
    ``experts.origin`` maps them back)."""
    cap_inputs = cap_inputs or inputs
    origin = experts.origin if experts is not None and experts.origin else list(range(len(inputs)))
    index_of = {i.fqn: origin[k] for k, i in enumerate(cap_inputs) if i.kind != "input"}
    state_order = [index_of[f] for f in program.input_fqns]
    input_order = [k for k, i in enumerate(inputs) if i.kind == "input"]
    grad_params = [index_of[f] for f in program.param_fqns]
    roles = [r for r in program.output_roles if r.startswith("grad_in:")]
    differentiable_inputs = [k for k, i in enumerate(input_order) if inputs[i].requires_grad]
    if len(roles) != len(differentiable_inputs):
        raise AdaptdistError(f"the program has {len(roles)} input gradients for {len(differentiable_inputs)} "
                             "inputs that require grad")
    return CompiledStep(split, [i.kind for i in inputs], state_order, input_order, grad_params, layouts, io,
                        world, tangent_outputs, differentiable_inputs, rank, program, expert_rows)


def _note_graph_breaks(gm: torch.fx.GraphModule) -> None:
    """Record where new graph breaks are: Dynamo records a break before it compiles the graph that ends
    there, so the breaks new at this compile are after this graph's last line of user code. One break per
    new reason: Dynamo counts one break several times when it restarts the frame's analysis, so its counts
    are not the number of breaks (GPT-2's one logging call counted 3 times for 2 graphs)."""
    reasons = compat.new_graph_break_reasons()
    if not reasons:
        return
    lines = [m.group(1) + ":" + m.group(2) for n in gm.graph.nodes if n.meta.get("stack_trace")
             for m in [list(_FRAME.finditer(n.meta["stack_trace"]))[-1]]]
    for reason in reasons:
        compat.note_graph_break(f"after {lines[-1]}" if lines else "(no source line recorded)", reason)


def _data_dependent_hint() -> str:
    """After a graph break on a dynamic-shape op (``nonzero``, ``torch.where(mask)``), the next graphs get
    data-dependent shapes, which fail less clearly (a symbolic size, ranks with different graphs): the advice
    to append to such a failure, or "" when no such break was seen (issue 14, moe)."""
    sites = [site for site, reason in compat.graph_break_sites() if reason.startswith("Dynamic shape operator")]
    if not sites:
        return ""
    from .capture import data_dependent_message

    return ". " + data_dependent_message("The compiled model", f"(a graph break on a dynamic-shape operator, {sites[0]})")


def _cause_first(hint: str, error: BaseException) -> str:
    """A failure after a data-dependent graph break: the cause (``hint``, :func:`_data_dependent_hint`) first, then
    what failed because of it (often an unclear consequence: a loss that "does not require gradients")."""
    first = (str(error).strip().splitlines() or [""])[0].rstrip(".")
    return f"{hint.removeprefix('. ')} (the capture failed because of it: {type(error).__name__}: {first})"


def _input_shapes_hint(inputs: list[GraphInput], control: Any) -> str:
    """For a mismatch: the advice naming a user input whose shape differs between ranks (uneven per-rank
    batches), or "" (a collective over ``control``: every rank in the mismatch calls it)."""
    from ..runtime.rank_input_shapes import input_shape_mismatch_hint, parse_input_shapes

    return input_shape_mismatch_hint([parse_input_shapes(t) for t in _all_gather_text(input_shapes_text(inputs), control)])


def _divergent_branch_hint() -> str:
    """For a mismatch after graph breaks: ranks whose data take different sides of a Python branch compile
    different graphs (the backend runs one graph on every rank), with what to do."""
    total, where = graph_break_summary(compat.graph_break_sites())
    if not total:
        return ""
    return (f". This process has {total} graph break(s) ({where}): after a branch on data (`if t.sum() > 0`), "
            "ranks whose rows take different sides compile different graphs. Compute both sides and select with "
            "torch.where(cond, a, b), or make the decision the same on every rank (e.g. from an all_reduce'd value)")


def graph_break_summary(breaks: dict[tuple[str, str], int]) -> tuple[int, str]:
    """How many graph breaks there are and where, from ``breaks`` ((site, reason) -> number of graphs that
    ended at that site for that reason): the total is the sum of the counts listed, one entry per site with
    its count and its reason(s), e.g. ``(2, "1 after a.py:3 (reason R); 1 after b.py:9 (reason R)")``."""
    by_site: dict[str, dict[str, int]] = {}
    for (site, reason), c in breaks.items():
        at = by_site.setdefault(site, {})
        at[reason] = at.get(reason, 0) + c
    parts = []
    for site, reasons in by_site.items():
        why = "; ".join(f"{r}{f' (x{c})' if len(reasons) > 1 else ''}" for r, c in reasons.items())
        parts.append(f"{sum(reasons.values())} {site} (reason: {why})")
    return sum(breaks.values()), "; ".join(parts)


def report_graph_breaks() -> None:
    """One warning for the graph breaks not reported yet: how many, where, and Dynamo's reasons. Called once
    the first step has compiled every graph (the first graph's first backward, or its second call)."""
    total, where = graph_break_summary(compat.graph_break_sites())
    if total <= compat.graph_breaks_reported(total):
        return
    warnings.warn(
        f"adaptdist: {total} graph break(s): {where}. Each graph between breaks is planned on its own, its "
        "inputs and outputs split over the ranks like the batch (communication at every break). Remove the breaks "
        "for one plan of the whole step; torch.compile(..., fullgraph=True) makes a break an error.",
        GraphBreakWarning, stacklevel=2)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
