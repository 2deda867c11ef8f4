"""adaptdist's C++ kernels: loading them, and whether they are there.

The kernels (``csrc/``, built by ``CMakeLists.txt`` through ``pip install``) are one shared library,
``adaptdist/_kernels.so``, that registers torch custom ops in the namespace ``torch.ops.adaptdist``
(shared-memory collectives: :mod:`adaptdist.kernels.shm`). Loading it registers the ops, so FX graphs,
rank programs and their artifacts that name them can be run, deserialized and traced.

When it is loaded: ``import adaptdist`` loads it if torch is already imported (a training script's
usual order), and so does importing any adaptdist module that uses torch (through
:mod:`adaptdist._torch_compat`); the CLI, which does not import torch until it needs it, pays nothing.

When it cannot be loaded (not built: no compiler or cmake at install time; a torch other than the one
it was built against; a corrupt file): one ``RuntimeWarning`` per process, :func:`available` is
False, :func:`load_error` says why, and callers use gloo. Never an exception at import. An explicit
request for the kernels then raises :class:`adaptdist.errors.ShmUnavailableError`
(:func:`require`).

``ADAPTDIST_KERNELS`` (environment): ``0``/``off`` disables loading (gloo everywhere, no warning);
a path loads that file instead of ``adaptdist/_kernels.so`` (tests use it to point at a missing or
corrupt library).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import ShmUnavailableError

LIBRARY_NAME = "_kernels.so"
ENV_VAR = "ADAPTDIST_KERNELS"
ABI_VERSION = 4
"""What ``torch.ops.adaptdist._abi_version()`` must return: bumped when an op's schema changes or an op is added
(2: ``_shm_group_set_comm_thread``; 3: the ``*_start`` ops and ``shm_wait``; 4: registered inputs,
``_shm_group_input_buffer`` and ``shm_flatten_all_reduce_start``)."""


@dataclass(frozen=True)
class LoadResult:
    """Outcome of loading the kernels: ``path`` tried (None when disabled), ``error`` (None when loaded)."""

    path: str | None
    error: str | None

    @property
    def loaded(self) -> bool:
        return self.error is None and self.path is not None


def library_path() -> Path:
    """Where the kernels are looked for: ``$ADAPTDIST_KERNELS`` when it is a path, else beside this package."""
    override = os.environ.get(ENV_VAR, "")
    if override and override.lower() not in ("0", "off", "1", "on"):
        return Path(override)
    return Path(__file__).resolve().parent.parent / LIBRARY_NAME


@functools.lru_cache(maxsize=1)
def load() -> LoadResult:
    """Load the kernels once per process (cached); warn once if they cannot be loaded. Imports torch."""
    if os.environ.get(ENV_VAR, "").lower() in ("0", "off"):
        return LoadResult(None, f"disabled by {ENV_VAR}={os.environ[ENV_VAR]}")
    path = library_path()
    import torch

    error = None
    if _registered(torch):
        # Already loaded in this process (possibly from another path): a second copy would register the
        # namespace twice, which torch treats as fatal.
        pass
    elif not path.is_file():
        error = (f"{path} does not exist (the C++ kernels were not built: reinstall with `pip install -e .` "
                 "on a machine with cmake and a C++ compiler, and see the install log)")
    else:
        try:
            torch.ops.load_library(str(path))
            abi = int(torch.ops.adaptdist._abi_version())
            if abi != ABI_VERSION:
                error = f"{path} has ABI version {abi}, this adaptdist needs {ABI_VERSION}: rebuild with `pip install -e .`"
        except Exception as exc:  # noqa: BLE001 -- any load failure falls back to gloo
            error = f"{path} could not be loaded: {type(exc).__name__}: {exc}"
    if error is not None:
        warnings.warn(f"adaptdist: C++ kernels unavailable, using gloo for all collectives: {error}",
                      RuntimeWarning, stacklevel=2)
    return LoadResult(str(path), error)


def _registered(torch) -> bool:
    try:
        torch.ops.adaptdist._abi_version  # noqa: B018 -- the lookup is the test
    except (AttributeError, RuntimeError):
        return False
    return True


def load_if_torch_imported() -> None:
    """Load the kernels if torch is already imported (``import adaptdist`` calls this; it never raises)."""
    if "torch" in sys.modules:
        load()


def available() -> bool:
    """Whether ``torch.ops.adaptdist`` ops can be used in this process (loads the kernels if needed)."""
    return load().loaded


def load_error() -> str | None:
    """Why the kernels are unavailable (None when they are loaded)."""
    return load().error


def require(what: str = "comm='shm'", advice: str = "Use comm='auto' or comm='gloo' (--comm auto|gloo)") -> None:
    """Raise :class:`ShmUnavailableError` unless the kernels are loaded; ``what`` names the request, ``advice`` the
    first thing to try (the command's own option)."""
    result = load()
    if not result.loaded:
        disabled = result.path is None  # ADAPTDIST_KERNELS=0/off
        fix = (f"unset {ENV_VAR} (or set it to 1)" if disabled else
               "build the kernels (`pip install -e .` with cmake and a C++ compiler installed)")
        raise ShmUnavailableError(
            f"{what} needs adaptdist's C++ shared-memory kernels, which are unavailable here: {result.error}. "
            f"{advice}, or {fix}.")
