"""Checkpoint directories on disk: written atomically, checked by a manifest of checksums, found newest-good-first.

A run's checkpoints live under one root (``OUT/checkpoints``), one directory per step::

    checkpoints/
      step-00000100/          a complete checkpoint: renamed into place only after every file was written
        manifest.json         {"format_version", "step", "files": {relative path: {"sha256", "bytes"}}}, written last
        meta.json             what the writer records (step, plan, cluster, config, model, state shapes, ...)
        ...                   the writer's files (torch.distributed.checkpoint shards, per-rank RNG states)
      .step-00000200.tmp/     being written (or left by a crash): never read, removed by the next writer

The protocol, for ranks sharing the file system (one host, or a shared mount)::

    tmp = prepare(root, step)          # rank 0 only; then a barrier
    ... every rank writes its files into tmp ...
    ... a barrier ...
    commit(tmp, meta, keep=K)          # rank 0 only: meta.json, manifest.json, fsync, rename, prune

A reader calls :func:`latest_good`: the newest directory whose manifest matches its files, skipping (and
naming) any that is partial or corrupt. The checksums are checked before anything in the directory is
loaded, because torch.distributed.checkpoint's ``.metadata`` is a pickle: a checkpoint is code, like an
artifact, and is to be loaded only from a source one trusts (the checksums catch corruption and mix-ups,
not a malicious author).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import CheckpointError

CHECKPOINT_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
META_NAME = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^\.step-(\d{8,})\.tmp$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, verified checkpoint directory: its ``path``, ``step`` and ``meta`` (meta.json)."""

    path: Path
    step: int
    meta: dict


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint after ``step`` steps: ``root/step-00000100``."""
    return Path(root) / f"step-{step:08d}"


def temporary_dir(root: Path, step: int) -> Path:
    """The temporary directory the checkpoint of ``step`` is written into before :func:`commit` renames it."""
    return Path(root) / f".step-{step:08d}.tmp"


def prepare(root: Path, step: int) -> Path:
    """Create the empty temporary directory every rank writes the checkpoint of ``step`` into (rank 0 only, then a
    barrier); a stale one of the same step, left by a crash, is removed first. Returns its path.

    Raises:
        CheckpointError: ``root`` cannot be created or written.
    """
    tmp = temporary_dir(root, step)
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints under {str(root)!r}: {e.strerror or e}; pass a writable "
                              "--out") from None
    return tmp


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, meta: Mapping[str, Any], keep: int | None = None) -> Path:
    """Finish the checkpoint written into ``tmp`` (rank 0 only, after every rank wrote its files): write
    ``meta.json`` (``meta`` must hold ``"step"``), then ``manifest.json`` with the sha256 and size of every file,
    flush them to disk, and rename the directory to its final name (replacing a checkpoint of the same step, e.g.
    one written before a restart). Then keep only the newest ``keep`` complete checkpoints (None: all).

    Returns:
        The final directory, ``root/step-XXXXXXXX``.

    Raises:
        CheckpointError: ``meta`` has no integer ``step``, or the file system refused a write.
    """
    tmp = Path(tmp)
    step = meta.get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint meta for {str(tmp)!r} needs an integer 'step' >= 0, got {step!r}")
    final = step_dir(tmp.parent, step)
    try:
        (tmp / META_NAME).write_text(json.dumps(dict(meta), indent=1, sort_keys=True))
        files = {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in _files(tmp)}
        manifest = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": step, "files": files}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for p in _files(tmp):
            _fsync(p)
        _fsync(tmp / MANIFEST_NAME)
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(final.parent)
    except OSError as e:
        raise CheckpointError(f"writing checkpoint {str(final)!r} failed: {e.strerror or e}") from None
    if keep is not None:
        prune(final.parent, keep)
    return final


def _step_dirs(root: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """``(step, path)`` of the directories under ``root`` whose name ``pattern`` matches (group 1: the step),
    oldest first; none where ``root`` is not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir())


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The checkpoint directories under ``root`` (complete or not, temporaries excluded), oldest first, as
    ``(step, path)``."""
    return _step_dirs(root, _STEP_DIR)


def unfinished_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The temporary directories under ``root`` (``.step-XXXXXXXX.tmp``: a write begun and never committed, e.g. an
    asynchronous checkpoint whose ranks stopped before its commit), oldest first, as ``(step, path)``."""
    return _step_dirs(root, _TMP_DIR)


def resume_note(root: Path, chosen: "CheckpointInfo | None") -> str | None:
    """Why a later checkpoint than ``chosen`` (the one a restart resumes from; None: it starts from step 0) is not
    used, when its write was begun and never committed (a line for the log), else None. E.g.
    ``checkpoint step-00000004 was not complete (its write was interrupted before its commit): resuming from
    step-00000002 (step 2)``."""
    from_step = chosen.step if chosen is not None else -1
    later = [p for step, p in unfinished_checkpoints(root) if step > from_step]
    if not later:
        return None
    names = ", ".join(p.name[1:-len(".tmp")] for p in later)
    where = (f"resuming from {chosen.path.name} (step {chosen.step})" if chosen is not None
             else "starting again from step 0 (no complete checkpoint)")
    return (f"checkpoint {names} {'was' if len(later) == 1 else 'were'} not complete (its write was interrupted "
            f"before its commit; an asynchronous checkpoint is committed at the next checkpoint): {where}")


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoint directories (and any temporary one) under ``root``.

    Raises:
        CheckpointError: ``keep`` < 1.
    """
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
    ckpts = list_checkpoints(root)
    for _, p in ckpts[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def verify(path: Path) -> dict:
    """Check a checkpoint directory against its manifest before anything in it is loaded: the manifest is there
    and readable, of a known format, and every file it lists is present with its size and sha256 (no file
    missing, truncated, or changed by one byte), and no unlisted file was added. Returns the parsed meta.json.

    Raises:
        CheckpointError: names the directory, the file and what differs.
    """
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise CheckpointError(f"{str(path)!r} has no {MANIFEST_NAME}: a partial checkpoint (its writer stopped "
                              "before the end)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        version = manifest["format_version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(mpath)!r} is not a checkpoint manifest ({type(e).__name__}: {e})") from None
    if version != CHECKPOINT_FORMAT_VERSION or not isinstance(files, dict):
        raise CheckpointError(f"{str(mpath)!r} has format_version {version!r}; this adaptdist reads "
                              f"{CHECKPOINT_FORMAT_VERSION}")
    for rel, want in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            raise CheckpointError(f"{str(path)!r} lacks {rel!r}, which its manifest lists")
        size = p.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{str(p)!r} has {size} bytes, its manifest says {want.get('bytes')} (truncated "
                                  "or replaced)")
        if sha256_file(p) != want.get("sha256"):
            raise CheckpointError(f"{str(p)!r} does not match its sha256 in the manifest (corrupted or replaced)")
    extra = [str(p.relative_to(path)) for p in _files(path) if str(p.relative_to(path)) not in files]
    if extra:
        raise CheckpointError(f"{str(path)!r} holds files its manifest does not list: {extra[:5]} (mixed from "
                              "two checkpoints?)")
    try:
        meta = json.loads((path / META_NAME).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path / META_NAME)!r} cannot be read: {e}") from None
    if meta.get("step") != manifest.get("step"):
        raise CheckpointError(f"{str(path)!r}: meta.json says step {meta.get('step')}, the manifest "
                              f"{manifest.get('step')}")
    return meta


def latest_good(root: Path, log: Callable[[str], None] | None = None) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` that passes :func:`verify`, or None when there is none. Each newer
    one that fails is named, with why, through ``log`` (e.g. ``checkpoint runs/x/checkpoints/step-00000200 is
    unusable (... does not match its sha256 ...); using the previous one``)."""
    for step, path in reversed(list_checkpoints(root)):
        try:
            meta = verify(path)
        except CheckpointError as e:
            if log is not None:
                log(f"checkpoint {path} is unusable ({e}); trying the previous one")
            continue
        return CheckpointInfo(path=path, step=step, meta=meta)
    return None


def check_same_model(meta: Mapping[str, Any], path: Path, model: str, state_shapes: Mapping[str, list[int]]) -> None:
    """Refuse a checkpoint written for another model: ``meta["state_shapes"]`` (state name -> global shape) must
    equal ``state_shapes``.

    Raises:
        CheckpointError: names both models and the first state that differs.
    """
    theirs = {k: list(v) for k, v in (meta.get("state_shapes") or {}).items()}
    ours = {k: list(v) for k, v in state_shapes.items()}
    if theirs == ours:
        return
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    differ = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    what = (f"it lacks {missing[:3]}" if missing else f"it has {extra[:3]} that the model does not" if extra else
            f"{differ[0]} is {theirs[differ[0]]} there but {ours[differ[0]]} here")
    raise CheckpointError(f"checkpoint {str(path)!r} was written for model {meta.get('model')!r}, not {model!r}: "
                          f"{what}; resume with the model it was written for, or start a new --out")
