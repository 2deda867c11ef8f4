"""Codegen: a localized GraphModule -> a RankProgram with readable Python source.

The source (:mod:`adaptdist.program_source`) is FX's own code for the graph, as a class ``RankProgramModule``,
with each value's local shape as a trailing comment::

    mm = torch.ops.aten.mm.default(view, t)  # f32[8, 256]
"""

from __future__ import annotations

import torch
import torch.fx

from .._version import __version__
from .. import graph_meta as gmeta
from ..program import RankProgram
from ..program_source import program_source, rewrite_source  # noqa: F401 -- rewrite_source re-exported
from ..mesh import Mesh

def make_rank_program(gm: torch.fx.GraphModule, mesh: Mesh, rank: int, batch_slice: tuple[int, int],
                      batch_size: int, input_fqns: list[str], param_fqns: list[str], num_batch_inputs: int,
                      state: dict[str, torch.Tensor], tied: dict[str, str], global_shapes: dict[str, list[int]],
                      state_placements: dict[str, list[str]]) -> RankProgram:
    """Wrap rank ``rank``'s localized graph as a RankProgram (code, state, constants).

    ``batch_slice`` is (first row, rows) of the global batch this rank reads; ``state_placements``
    maps each sharded state tensor to its placement text per mesh axis.
    """
    roles = gmeta.get_output_roles(gm.graph.output_node())
    off, size = batch_slice
    coords = ", ".join(f"{a}={c}" for a, c in zip(mesh.names, mesh.coords(rank)))
    header = (
        f"adaptdist {__version__} RankProgram, torch {torch.__version__}\n"
        f"rank {rank} of {mesh.world_size}, mesh {mesh} (this rank: {coords}), "
        f"batch rows [{off}, {off + size}) of {batch_size}\n"
        f"outputs: {', '.join(roles[:4])}{', ...' if len(roles) > 4 else ''} ({len(roles)} in all)\n"
        "Generated code: edit the model, not this file.\n"
        "inputs:\n" + "\n".join(
            f"  {ph.name}: {name}" for ph, name in zip(
                gm.graph.find_nodes(op="placeholder"),
                list(input_fqns) + [f"batch[{i}] (local rows)" for i in range(num_batch_inputs)])
        )
    )
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.find_nodes(op="get_attr")}
    batch_phs = list(gm.graph.find_nodes(op="placeholder"))[len(input_fqns):]
    batch_specs = [(list(n.meta["val"].shape), str(n.meta["val"].dtype).removeprefix("torch.")) for n in batch_phs]
    return RankProgram(
        rank=rank,
        world_size=mesh.world_size,
        mesh=mesh.as_dict(),
        group_names={a: mesh.group_name(a) for a in mesh.names},
        input_fqns=list(input_fqns),
        param_fqns=list(param_fqns),
        num_batch_inputs=num_batch_inputs,
        batch_slice=(off, size),
        output_roles=list(roles),
        code=program_source(gm, header),
        module=gm,
        state=state,
        constants={k: v for k, v in constants.items() if isinstance(v, torch.Tensor)},
        tied=dict(tied),
        batch_specs=batch_specs,
        state_placements={f: list(p) for f, p in state_placements.items()},
        global_shapes=dict(global_shapes),
    )
