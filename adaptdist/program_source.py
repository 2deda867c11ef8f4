"""A rank program's readable, executable Python source for its FX graph (what codegen writes, and what a late
rewrite of a loaded program writes again): FX's own code as a class ``RankProgramModule``, each value's local
shape as a trailing comment::

    mm = torch.ops.aten.mm.default(view, t)  # f32[8, 256]
"""

from __future__ import annotations

import re

import torch
import torch.fx

from . import graph_meta as gmeta

_ANNOTATED = re.compile(r'^(\s+)(\w+): "([^"]*)" = (.*)$')


def program_source(gm: torch.fx.GraphModule, header: str) -> str:
    """Readable, executable source for ``gm``; ``header`` becomes a leading comment block."""
    where = {}
    for n in gm.graph.nodes:
        n.meta.pop("stack_trace", None)  # traces point into aot's re-trace, not user code
        mod = gmeta.module_of(n)
        if mod:
            where[n.name] = mod
    src = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = []
    for line in src.splitlines():
        m = _ANNOTATED.match(line)
        if m:
            indent, name, ann, rhs = m.groups()
            line = f"{indent}{name} = {rhs}  # {ann}" + (f"  {where[name]}" if name in where else "")
        elif line.strip() == "# No stacktrace found for following nodes":
            continue
        lines.append(line)
    body = "\n".join(lines).replace("class GraphModule(torch.nn.Module):", "class RankProgramModule(torch.nn.Module):", 1)
    head = "\n".join(f"# {h}" if h else "#" for h in header.splitlines())
    return f"{head}\nimport torch\nfrom torch import device\n\n\n{body}\n"


def rewrite_source(code: str, gm: torch.fx.GraphModule) -> str:
    """A program's source for ``gm`` after a late pass changed it, keeping ``code``'s header comment."""
    header = []
    for line in code.splitlines():
        if not line.startswith("#"):
            break
        header.append(line[2:] if line.startswith("# ") else "")
    return program_source(gm, "\n".join(header))
