"""Which private torch names ``adaptdist/_torch_compat.py`` reaches exist in the torch this runs on.

    PYTHONPATH=. python benchmarks/device_check_compat.py

Reads ``_torch_compat.py``'s source (no import of adaptdist): every ``from torch.X import Y`` and every
``torch.a.b.c`` attribute chain in it, resolved here one by one (modules imported, attributes looked up). Prints
the torch version and one line per name that does not resolve (``MISSING``), then a count; exit status 0 either
way (``device_check.sh`` prints it as a figure of the machine). A name missing here breaks only the
``_torch_compat`` functions that use it; those that have a fallback for older torch say so in their docstrings.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "adaptdist" / "_torch_compat.py"


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch":
        return ["torch", *reversed(parts)]
    return None


def names(source: str) -> list[tuple[str, str]]:
    """``(module, attribute path)`` pairs the source reaches in torch, in first-seen order."""
    found: dict[tuple[str, str], None] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                found[(node.module, alias.name)] = None
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and any(p.startswith("_") for p in chain[1:]):
                found[("torch", ".".join(chain[1:]))] = None
    # keep only the longest chain of each prefix (torch._C._x.y covers torch._C._x)
    # torch.testing's (op_db, FakeStore) serve adaptdist's tests only, and importing them takes long: left out
    keys = [k for k in found if not k[0].startswith("torch.testing")]
    return [k for k in keys if not any(o != k and o[0] == k[0] and o[1].startswith(k[1] + ".") for o in keys)]


def resolve(module: str, path: str) -> str | None:
    """None when ``module``'s ``path`` resolves; else why not."""
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"import {module}: {type(e).__name__}: {e}"
    done = module
    for part in path.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            try:
                obj = importlib.import_module(f"{done}.{part}")
            except Exception:  # noqa: BLE001
                return f"{done} has no {part}"
        done = f"{done}.{part}"
    return None


def main() -> int:
    import torch

    pairs = names(SOURCE.read_text())
    missing = [(m, p, why) for m, p in pairs if (why := resolve(m, p)) is not None]
    print(f"torch {torch.__version__}: {len(pairs)} private names reached by adaptdist/_torch_compat.py, "
          f"{len(missing)} missing")
    for m, p, why in missing:
        print(f"MISSING {m}:{p} ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
