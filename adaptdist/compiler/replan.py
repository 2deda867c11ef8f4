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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UsageError
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
        base_world_size, base_program_dir: the programs compiled before launch and their world size.
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
                    message: Callable[[str], None] = log.info) -> str:
        """The directory of the programs for ``world_size`` ranks. Collective over the job's ranks: rank 0 finds or
        compiles them and ``publish`` (e.g. a broadcast) hands its answer to every rank (rank 0 calls it with the
        path, the others with None and get the path back).

        Raises:
            AdaptdistError: the model cannot be planned or lowered for ``world_size`` ranks (the message says which).
        """
        if world_size == self.base_world_size:
            return self.base_program_dir
        path = self._find_or_compile(world_size, message) if rank == 0 else None
        return publish(path)

    def _find_or_compile(self, world_size: int, message: Callable[[str], None]) -> str:
        import torch

        from ..annotations import ManualPlan
        from ..calibrate.local import local_cluster
        from ..model_spec import ModelSpec
        from ..plan import graph_fingerprint
        from ..program import save_programs
        from .capture import capture
        from .lowering import compile_model

        spec = ModelSpec.parse(self.model)
        torch.manual_seed(self.seed)
        model, example, loss_fn = spec.build(self.batch_size, self.seq_len)
        captured = capture(model, example, loss_fn)
        cluster = local_cluster(world_size)
        key = {"graph": graph_fingerprint(captured.gm), "cluster": cluster.topology_fingerprint(),
               "world_size": world_size, "plan": self.plan, "mesh": self.mesh, "optimizer": self.optimizer,
               "batch_size": self.batch_size, "seq_len": self.seq_len,
               "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.options).items()
                           if k != "dump_dir"}}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        entry = Path(self.cache_dir) / f"world{world_size}-{digest}"
        if _cached(entry, key):
            message(f"reusing the programs planned for this graph on {cluster!r} ({entry})")
            return str(entry)
        if self.plan == "auto":
            from .planner.summary import run_planner

            plan = run_planner(captured, cluster, None, self.optimizer).plan
        else:
            plan = ManualPlan.parse(self.plan, spec.module())
        programs = compile_model(model, example, loss_fn, world_size, plan, self.options, captured=captured)
        tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save_programs(programs, tmp, extra_files={CACHE_KEY_FILE: json.dumps(key, sort_keys=True, default=str)})
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
        p0 = programs[0]
        mesh = ",".join(f"{a}={n}" for a, n in p0.mesh.items())
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

