"""Programs for the world size an elastic job finds itself at: re-planned, lowered and cached.

When ranks leave or join, the job's programs (lowered for the old world size) no longer fit. A
:class:`ProgramSource` travels with the job's configuration to every rank; at each (re)start the ranks ask it
for the directory of their programs (:meth:`ProgramSource.program_dir`). For the world size the job was
compiled for it is the directory compiled before launch; for another, rank 0 captures the model, plans the
same ``--plan`` (an automatic plan is planned anew for the new cluster) and lowers it, once per graph and
cluster: the programs are cached under ``cache_dir`` keyed by the graph's fingerprint and the cluster
topology's fingerprint (and the plan, mesh, lowering options, batch and sequence size), so going back to a
size seen before reuses them, and the reuse is logged. A cache entry records its key; one made for another
cluster or graph is never reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..errors import PipelineError, UsageError
from ..lowering_options import LoweringOptions

log = logging.getLogger("adaptdist")

CACHE_KEY_FILE = "cache_key.json"


@dataclass(frozen=True)
class ProgramSource:
    """What a rank needs to obtain programs for any world size (picklable: it crosses the process spawn).

    Attributes:
        model: ``FILE.py:FACTORY`` as given to ``adaptdist train``.
        batch_size, seq_len: the global batch (the same at every world size: a step means the same thing).
        seed: the model's initialisation seed (``torch.manual_seed(seed)`` before the factory, as ``train``).
        plan: ``--plan`` (``auto``, a preset or a plan file path).
        mesh: ``--mesh`` or None; a fixed mesh cannot follow the world size (refused by :meth:`check_elastic`).
        optimizer: sizes the optimizer state an automatic plan must fit.
        options: the lowering options.
        cache_dir: where programs for other world sizes are kept.
        base_world_size, base_program_dir: the programs compiled before launch and their world size (0 and ""
            when nothing was compiled before launch: a job over several hosts learns its size at the rendezvous).
        ranks_per_host: None: every rank on this host; else the job spans ``world_size // ranks_per_host``
            hosts of this many ranks each (``--nnodes``), planned as such.
        compile_wait_s: how long the other ranks of a host wait for its local rank 0 to compile.
        precision, activation_checkpointing: ``--precision`` and ``--activation-checkpointing``
            (:func:`~adaptdist.compiler.training_features.apply_training_features`).
        microbatches, schedule: ``--microbatches`` and ``--schedule`` of a pipeline plan (``plan == "pp"``: one
            stage group per rank at every world size).
        data_path: ``--data``, for a factory that sizes the model from the data (``factory(..., data_path=)``).
    """

    model: str
    batch_size: int
    seq_len: int
    seed: int
    plan: str
    mesh: str | None
    optimizer: str
    cache_dir: str
    base_world_size: int
    base_program_dir: str
    options: LoweringOptions = field(default_factory=LoweringOptions)
    ranks_per_host: int | None = None
    compile_wait_s: float = 600.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    microbatches: int | None = None
    schedule: str | None = None
    data_path: str | None = None

    def cluster_for(self, world_size: int):
        """The cluster a job of ``world_size`` ranks plans for (estimated figures), its one-host collectives priced
        as ``options.comm`` carries them (:func:`~adaptdist.comm_transport.cluster_for_comm`)."""
        from ..calibrate.local import estimated_cluster, local_cluster
        from ..comm_transport import cluster_for_comm

        if self.ranks_per_host is None:
            return cluster_for_comm(local_cluster(world_size), self.options.comm)
        if world_size % self.ranks_per_host:
            raise UsageError(f"{world_size} ranks are not whole hosts of {self.ranks_per_host} (--nproc) ranks")
        return cluster_for_comm(estimated_cluster(tuple((f"host{h}", "cpu", self.ranks_per_host)
                                                        for h in range(world_size // self.ranks_per_host))),
                                self.options.comm)

    def check_elastic(self) -> None:
        """Refuse settings that cannot follow a changing world size.

        Raises:
            UsageError: a fixed ``--mesh`` or a plan file that fixes one.
        """
        if self.mesh:
            raise UsageError(f"--mesh {self.mesh} fixes the number of ranks, so it cannot follow an elastic world "
                             "size (--nproc MIN:MAX); leave --mesh out (the plan's mesh is chosen per world size)")
        if self.plan.endswith(".json"):
            raise UsageError(f"--plan {self.plan} is a saved plan with a fixed mesh; an elastic world size "
                             "(--nproc MIN:MAX) needs --plan auto or a preset (dp, fsdp, tp, dp,tp) or a YAML "
                             "plan of globs")

    def program_dir(self, world_size: int, rank: int, publish: Callable[[str | None], str],
                    message: Callable[[str], None] = log.info, local_rank: int = 0) -> str:
        """The directory of the programs for ``world_size`` ranks. Collective over the job's ranks: rank 0 finds or
        compiles them and ``publish`` (e.g. a broadcast) hands its answer to every rank (rank 0 calls it with the
        path, the others with None and get the path back). On a host that does not see rank 0's files (another
        machine), the host's local rank 0 compiles the same programs (planning is deterministic: the same key,
        the same path) while its other ranks wait for them, at most ``compile_wait_s``.

        Raises:
            AdaptdistError: the model cannot be planned or lowered for ``world_size`` ranks (the message says which).
            RuntimeLaunchError: the programs did not appear within ``compile_wait_s``.
        """
        if world_size == self.base_world_size:
            return self.base_program_dir
        path = self._find_or_compile(world_size, message) if rank == 0 else None
        path = publish(path)
        if (Path(path) / "manifest.json").is_file():
            return path
        if local_rank == 0:
            mine = self._find_or_compile(world_size, message)
            if mine != path:
                raise UsageError(f"this host planned {mine}, rank 0 planned {path}: the hosts differ in their "
                                 "adaptdist, torch or model file; install the same everywhere")
            return path
        import time

        from ..errors import RuntimeLaunchError

        deadline = time.monotonic() + self.compile_wait_s
        while not (Path(path) / "manifest.json").is_file():
            if time.monotonic() > deadline:
                raise RuntimeLaunchError(f"rank {rank}: the programs {path} did not appear within "
                                         f"{self.compile_wait_s:.0f} s (compile_wait_s)")
            time.sleep(0.2)
        return path

    def rebalance(self, program_dir: str, cluster, measured_compute_s: list[float], noise: list[float], step: int,
                  directory: str | os.PathLike):
        """Rank 0's part of an adaptive re-balance (:mod:`adaptdist.runtime.rebalance`): the decision for the
        programs in ``program_dir`` (every rank's) running on ``cluster`` with ``measured_compute_s`` per rank
        (their relative standard errors ``noise``; :func:`.rebalance_rows.decide`) and, when it applies, the programs lowered with its rows in
        ``directory`` (:meth:`lower_with_rows`). Returns ``(decision, directory or None)``.

        Raises:
            AdaptdistError: as :func:`.rebalance_rows.decide` and :meth:`lower_with_rows`.
        """
        from ..program import load_program
        from .rebalance_rows import decide

        programs = {r: load_program(program_dir, r, world_size=cluster.world_size) for r in range(cluster.world_size)}
        decision = decide(programs, cluster, measured_compute_s, self.optimizer, step, noise=noise)
        if not decision.applied:
            return decision, None
        return decision, self.lower_with_rows(programs[0].plan, cluster, decision.rows_after, directory)

    def lower_with_rows(self, plan, cluster, rows: tuple[int, ...], directory: str | os.PathLike) -> str:
        """The job's model captured again and ``plan`` (the running programs' plan, its rank mapping kept) lowered
        for ``cluster`` (the job's) with ``rows`` per batch-axis coordinate, saved in ``directory``: the programs of
        an adaptive re-balance (:mod:`adaptdist.runtime.rebalance`). Returns the directory.

        Raises:
            AdaptdistError: the plan does not lower with those rows (the message says why).
        """
        from ..comm_transport import rank_hosts
        from ..model_spec import ModelSpec
        from ..program import save_programs
        from .capture import capture
        from .lowering import compile_model
        from .training_features import apply_training_features

        import torch

        spec = ModelSpec.parse(self.model)
        torch.manual_seed(self.seed)
        model, example, loss_fn = spec.build(self.batch_size, self.seq_len, data_path=self.data_path)
        model, loss_fn = apply_training_features(model, loss_fn, self.precision, self.activation_checkpointing)
        captured = capture(model, example, loss_fn)
        options = replace(self.options, hosts=rank_hosts(cluster))
        programs = compile_model(model, example, loss_fn, cluster.world_size, plan, options, captured=captured,
                                 cluster=cluster, optimizer=self.optimizer, batch_split=tuple(rows))
        tmp = Path(str(directory) + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save_programs(programs, tmp)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        return str(directory)

    def _find_or_compile(self, world_size: int, message: Callable[[str], None]) -> str:
        import torch

        from ..annotations import ManualPlan
        from ..model_spec import ModelSpec
        from ..plan import graph_fingerprint
        from ..program import save_programs
        from .capture import capture
        from .lowering import compile_model

        spec = ModelSpec.parse(self.model)
        torch.manual_seed(self.seed)
        model, example, loss_fn = spec.build(self.batch_size, self.seq_len, data_path=self.data_path)
        from .training_features import apply_training_features

        model, loss_fn = apply_training_features(model, loss_fn, self.precision, self.activation_checkpointing)
        captured = capture(model, example, loss_fn)
        cluster = self.cluster_for(world_size)
        key = {"graph": graph_fingerprint(captured.gm), "cluster": cluster.topology_fingerprint(),
               "world_size": world_size, "plan": self.plan, "mesh": self.mesh, "optimizer": self.optimizer,
               "batch_size": self.batch_size, "seq_len": self.seq_len,
               **({"microbatches": self.microbatches, "schedule": self.schedule} if self.plan == "pp" else {}),
               "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.options).items()
                           if k != "dump_dir"}}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        entry = Path(self.cache_dir) / f"world{world_size}-{digest}"
        if _cached(entry, key):
            message(f"reusing the programs planned for this graph on {cluster!r} ({entry})")
            return str(entry)
        pipeline = None
        if self.plan == "pp":  # a pipeline over every rank (issue 15): what the flags leave open, the planner chooses
            from .pipeline_auto import choose_pipeline_plan

            plan = choose_pipeline_plan(captured, cluster, world_size, microbatches=self.microbatches,
                                        schedule=self.schedule, optimizer=self.optimizer).plan
            pipeline = True
        elif self.plan == "auto":
            from .planner.summary import run_planner

            plan = run_planner(captured, cluster, None, self.optimizer).plan
        else:
            plan = ManualPlan.parse(self.plan, spec.module(), model)
        try:
            from ..comm_transport import rank_hosts

            options = replace(self.options, hosts=rank_hosts(cluster))  # this world size's hosts (--comm)
            programs = compile_model(model, example, loss_fn, world_size, plan, options, captured=captured)
        except PipelineError as e:
            if pipeline is None:
                raise
            s = self.schedule or "the planner's choice"
            m = self.microbatches if self.microbatches is not None else "the planner's choice"
            raise PipelineError(
                f"the run's pipeline (--schedule {s}, --microbatches {m}) does not fit "
                f"{world_size} ranks: {str(e).split('; use ')[0]}. A resumed run keeps its --microbatches and "
                f"--schedule: resume on fewer ranks (with 1f1b/zb at most as many as microbatches, and a count "
                f"whose microbatches split the batch rows evenly), or start a new run with another --out") from e
        tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        extra_files = {CACHE_KEY_FILE: json.dumps(key, sort_keys=True, default=str)}
        if pipeline is not None:
            from ..stage_program_io import save_pipeline_programs

            save_pipeline_programs(programs, tmp, extra_files=extra_files)
        else:
            save_programs(programs, tmp, extra_files=extra_files)
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
        p0 = programs[0]
        mesh = ",".join(f"{a}={n}" for a, n in (p0.plan.mesh if pipeline is not None else p0.mesh).items())
        message(f"planned {p0.plan.name!r} (mesh {mesh}) for {cluster!r}; programs cached in {entry}")
        return str(entry)


def _cached(entry: Path, key: dict) -> bool:
    """Whether ``entry`` holds complete programs made for exactly ``key`` (its recorded key file matches)."""
    f = entry / CACHE_KEY_FILE
    if not (entry / "manifest.json").is_file() or not f.is_file():
        return False
    try:
        return json.loads(f.read_text()) == json.loads(json.dumps(key, sort_keys=True, default=str))
    except ValueError:
        return False

