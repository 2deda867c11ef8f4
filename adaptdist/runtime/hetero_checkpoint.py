"""Checkpoints of ``--mode async-hetero`` (:mod:`adaptdist.runtime.async_hetero`), and loading them onto another
layout (another number of sparse or dense ranks, tables sharded by rows or by tables).

A checkpoint directory (:mod:`.checkpoint_store`'s protocol: ``prepare`` ... ``commit``, a manifest of sha256
sums, verified before anything is read) holds, besides ``meta.json`` and ``manifest.json``::

    sparse/rank{r}.safetensors   sparse rank r's table shards: "table{t}.{start}.{end}.weight" (rows start..end-1
                                 of table t) and, with AdamW, ".exp_avg", ".exp_avg_sq", ".step" of the same rows
    dense.safetensors            one dense rank's replica: "model.{name}" (dense_arch's state) and
                                 "optim.{i}.{key}" (its optimizer's state of parameter i)

``meta.json``: ``kind: "async-hetero"``, ``step`` (steps done), the losses so far, the optimizer, the tables' rows
and width, the layout it was written under. No pickle anywhere.

In-flight queue items: a checkpoint is taken at a step boundary ``s`` after the queues are drained: each sparse
rank applies the table gradients of every step ``< s`` (instead of only those ``< s - K``) and each dense rank has
finished step ``s - 1`` and its sends. Nothing in flight is saved; the drain is part of the schedule (a run that
checkpoints every N steps drains every N steps whether or not it is resumed), so a resumed run equals the
uninterrupted run with the same ``--checkpoint-every`` for every K, and for K = 0 (where the drain changes
nothing) the uninterrupted run without checkpoints too.

Resharding: each new shard ``(table, rows a..b-1)`` is assembled from the saved pieces that overlap it (any
layout to any layout); rows no saved piece covers are a :class:`~adaptdist.errors.CheckpointError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch

from ..errors import CheckpointError
from ..hetero_layout import HeteroLayout

KIND = "async-hetero"
SPARSE_DIR = "sparse"
DENSE_FILE = "dense.safetensors"
_PIECE = re.compile(r"^table(\d+)\.(\d+)\.(\d+)\.(weight|exp_avg|exp_avg_sq|step)$")


def sparse_tensors(worker) -> dict[str, torch.Tensor]:
    """A :class:`~adaptdist.runtime.async_hetero.SparseWorker`'s shards (and AdamW state) as flat tensors."""
    out = {}
    for s, w in zip(worker.shards, worker.weights):
        key = f"table{s.table}.{s.row_start}.{s.row_end}"
        out[f"{key}.weight"] = w.detach().clone().contiguous()
        if worker.opt is not None:
            for name, v in worker.opt.state.get(w, {}).items():
                out[f"{key}.{name}"] = torch.as_tensor(v).detach().clone().contiguous()
    return out


def dense_tensors(worker) -> dict[str, torch.Tensor]:
    """A :class:`~adaptdist.runtime.async_hetero.DenseWorker`'s ``dense_arch`` state and optimizer state."""
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in worker.dense_arch.state_dict().items()}
    for i, st in worker.opt.state_dict()["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) or isinstance(v, (int, float)):
                out[f"optim.{i}.{key}"] = torch.as_tensor(v).detach().clone().contiguous()
    return out


def write_sparse(directory: Path, rank: int, worker) -> None:
    """Write sparse rank ``rank``'s file into the checkpoint's temporary ``directory``."""
    from safetensors.torch import save_file

    (Path(directory) / SPARSE_DIR).mkdir(exist_ok=True)
    save_file(sparse_tensors(worker), str(Path(directory) / SPARSE_DIR / f"rank{rank}.safetensors"))


def write_dense(directory: Path, worker) -> None:
    """Write one dense replica into the checkpoint's temporary ``directory``."""
    from safetensors.torch import save_file

    save_file(dense_tensors(worker), str(Path(directory) / DENSE_FILE))


def meta(step: int, layout: HeteroLayout, optimizer: str, table_rows: Sequence[int], dim: int, model: str,
         losses: Sequence[float]) -> dict:
    """``meta.json`` of an async-hetero checkpoint after ``step`` steps."""
    return {"kind": KIND, "step": int(step), "optimizer": optimizer, "table_rows": list(table_rows), "dim": int(dim),
            "model": model, "losses": [float(x) for x in losses], "layout": layout.describe()}


def check_meta(info_meta: dict, path: Path, optimizer: str, table_rows: Sequence[int], dim: int) -> None:
    """Refuse a checkpoint that is not an async-hetero one of this model and optimizer.

    Raises:
        CheckpointError: names the checkpoint and what differs.
    """
    if info_meta.get("kind") != KIND:
        raise CheckpointError(f"checkpoint {str(path)!r} is a --mode sync checkpoint, not an async-hetero one: resume "
                              "it with --mode sync")
    if list(info_meta.get("table_rows", [])) != list(table_rows) or info_meta.get("dim") != dim:
        raise CheckpointError(f"checkpoint {str(path)!r} holds tables of {info_meta.get('table_rows')} rows x "
                              f"{info_meta.get('dim')}, the model has {list(table_rows)} x {dim}: another model or "
                              "data set; resume with the one it was written for, or start a new --out")
    if info_meta.get("optimizer") != optimizer:
        raise CheckpointError(f"checkpoint {str(path)!r} was trained with --optimizer {info_meta.get('optimizer')}, "
                              f"not {optimizer}")


def _pieces(directory: Path) -> dict[tuple[int, int, int], dict[str, object]]:
    """{(table, start, end): {kind: lazy slice}} over every sparse file of the checkpoint."""
    from safetensors import safe_open

    files = sorted((Path(directory) / SPARSE_DIR).glob("rank*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {str(directory)!r} has no {SPARSE_DIR}/rank*.safetensors: not an "
                              "async-hetero checkpoint")
    out: dict = {}
    for f in files:
        h = safe_open(str(f), framework="pt")
        for key in h.keys():
            m = _PIECE.match(key)
            if m is None:
                raise CheckpointError(f"{str(f)!r} holds {key!r}, which is not a table piece")
            t, a, b = int(m.group(1)), int(m.group(2)), int(m.group(3))
            out.setdefault((t, a, b), {})[m.group(4)] = (h, key)
    return out


def load_sparse(directory: Path, worker) -> None:
    """Fill ``worker``'s shards (and AdamW state) from the checkpoint's pieces, whatever layout wrote them.

    Raises:
        CheckpointError: a row of a shard no saved piece holds, or AdamW state missing for a piece.
    """
    pieces = _pieces(Path(directory))
    states = {}
    for k, (shard, w) in enumerate(zip(worker.shards, worker.weights)):
        filled = torch.zeros(shard.rows, dtype=torch.bool)
        kinds = ("weight", "exp_avg", "exp_avg_sq") if worker.opt is not None else ("weight",)
        got = {kind: torch.empty(shard.rows, worker.dim) for kind in kinds}
        steps = set()
        for (t, a, b), parts in pieces.items():
            lo, hi = max(a, shard.row_start), min(b, shard.row_end)
            if t != shard.table or lo >= hi:
                continue
            for kind in kinds:
                if kind not in parts:
                    raise CheckpointError(f"checkpoint {str(directory)!r}: table {t} rows {a}..{b - 1} lack "
                                          f"{kind} (saved with another optimizer?)")
                h, key = parts[kind]
                got[kind][lo - shard.row_start:hi - shard.row_start] = h.get_slice(key)[lo - a:hi - a]
            if worker.opt is not None:
                h, key = parts.get("step", (None, None))
                if h is None:
                    raise CheckpointError(f"checkpoint {str(directory)!r}: table {t} rows {a}..{b - 1} lack step")
                steps.add(float(h.get_tensor(key)))
            filled[lo - shard.row_start:hi - shard.row_start] = True
        if not bool(filled.all()):
            missing = int((~filled).nonzero()[0]) + shard.row_start
            raise CheckpointError(f"checkpoint {str(directory)!r} holds no row {missing} of table {shard.table} "
                                  f"(needed by {shard!r}): an incomplete checkpoint")
        with torch.no_grad():
            w.copy_(got["weight"])
        if worker.opt is not None:
            if len(steps) != 1:
                raise CheckpointError(f"checkpoint {str(directory)!r}: the pieces of {shard!r} were saved at "
                                      f"different optimizer steps {sorted(steps)}")
            states[k] = {"step": torch.tensor(steps.pop()), "exp_avg": got["exp_avg"],
                         "exp_avg_sq": got["exp_avg_sq"]}
    if worker.opt is not None:
        sd = worker.opt.state_dict()
        worker.opt.load_state_dict({"state": states, "param_groups": sd["param_groups"]})


def load_dense(directory: Path, worker) -> None:
    """Load ``dense.safetensors`` into a :class:`~adaptdist.runtime.async_hetero.DenseWorker`.

    Raises:
        CheckpointError: the file is missing or does not fit the dense part.
    """
    from safetensors.torch import load_file

    f = Path(directory) / DENSE_FILE
    if not f.is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r} has no {DENSE_FILE}")
    flat = load_file(str(f))
    model = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    try:
        worker.dense_arch.load_state_dict(model)
    except RuntimeError as e:
        raise CheckpointError(f"{str(f)!r} does not fit the model's dense part: {e}") from None
    state: dict = {}
    for k, v in flat.items():
        if k.startswith("optim."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    sd = worker.opt.state_dict()
    worker.opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})

