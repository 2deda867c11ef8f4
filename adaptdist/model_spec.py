"""Naming a model on the command line: ``FILE.py:FACTORY``.

``FACTORY(batch_size, seq_len)`` returns ``(model, example_batch, loss_fn)`` (a
factory that takes ``data_path=`` gets ``--data``, to size the model from the
data); the file may define ``data(batch_size, seq_len, path=None, seed=0)``
yielding global batches, ``sample(model, num_bytes)`` returning text, and
``evaluate(model, path=None, batch_size=None, steps=None)`` returning
``(fields, line)``: metrics of the trained model for summary.json and the log.
The default, ``builtin:gpt``, is adaptdist's own GPT on the embedded corpus;
``builtin:dlrm`` a recommender on movie ratings (:mod:`adaptdist.models.dlrm`).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from .errors import AdaptdistError, UsageError

BUILTIN = {
    "builtin:gpt": (Path(__file__).parent / "models" / "gpt.py", "factory"),
    "builtin:llama": (Path(__file__).parent / "models" / "llama.py", "factory"),
    "builtin:dlrm": (Path(__file__).parent / "models" / "dlrm.py", "factory"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``FILE.py:FACTORY`` (or a built-in name)."""

    file: Path
    factory: str
    text: str

    @staticmethod
    def parse(text: str) -> "ModelSpec":
        """Parse and check that the file exists.

        Raises:
            UsageError: not of the form FILE.py:FACTORY, or the file does not exist.
        """
        if text in BUILTIN:
            f, fn = BUILTIN[text]
            return ModelSpec(f, fn, text)
        file, sep, fn = text.rpartition(":")
        if not sep or not file.endswith(".py") or not fn.isidentifier():
            raise UsageError(
                f"model {text!r} is not of the form FILE.py:FACTORY (e.g. mymodel.py:factory), "
                f"nor a built-in ({', '.join(BUILTIN)})"
            )
        p = Path(file)
        if not p.is_file():
            raise UsageError(f"model file {file!r} does not exist")
        return ModelSpec(p.resolve(), fn, text)

    def module(self):
        """Import the model file.

        Raises:
            UsageError: the file fails to import; names the file, line and error.
        """
        try:
            return load_module(str(self.file), "adaptdist_model_module")
        except Exception as e:
            raise UsageError(f"importing {self.file} failed{_where(e, self.file)}: {type(e).__name__}: {e}") from e

    def build(self, batch_size: int, seq_len: int, data_path: str | None = None) -> tuple[nn.Module, tuple, Callable]:
        """Call the factory (with ``data_path=``, ``--data``, when it takes that argument) and check what it
        returns.

        Raises:
            UsageError: the factory is missing or returns something other than (model, batch, loss_fn).
            DataError: the factory found the data bad (passed on as it is: it names the file and line).
        """
        mod = self.module()
        fn = getattr(mod, self.factory, None)
        if not callable(fn):
            raise UsageError(f"{self.file} has no function {self.factory!r}")
        from .errors import DataError

        try:
            out: Any = fn(batch_size, seq_len, **({"data_path": data_path} if _takes(fn, "data_path") else {}))
        except DataError:
            raise
        except Exception as e:
            raise UsageError(
                f"{self.text}({batch_size}, {seq_len}) raised{_where(e, self.file)}: {type(e).__name__}: {e}; "
                "the factory is called as factory(batch_size, seq_len)"
            ) from e
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], nn.Module) and callable(out[2])):
            got = (f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                   if isinstance(out, tuple) else type(out).__name__)
            raise UsageError(
                f"{self.text}: the factory must return (model: nn.Module, example_batch: tuple, loss_fn), got {got}"
            )
        return out


def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` has a parameter called ``name``."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _where(e: BaseException, file: Path) -> str:
    """' at FILE:LINE' for the deepest traceback frame in the user's file, if any."""
    import traceback

    if isinstance(e, SyntaxError) and e.lineno:
        return f" at {e.filename}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == file]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


def load_module(path: str, name: str = "adaptdist_user_module"):
    """Import a Python file by path."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # like `python FILE.py`: modules beside it are importable
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AdaptdistError(f"cannot import {path!r} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
