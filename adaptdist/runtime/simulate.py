"""Run every rank's program in one process, with collectives simulated on the mesh's groups.

Used by tests (numerics without processes, on meshes larger than this machine could
run) and for debugging a lowering. Each rank's graph runs node by node until it
reaches a collective; when every member of that collective's group (the ranks that
share all other mesh coordinates) has reached a collective on the same group, it is
carried out exactly as the real one computes it: ``all_reduce`` sums, ``all_gather``
concatenates on dim 0 (equal shapes required, as the real collective requires),
``reduce_scatter`` gives member i block i of the sum; ``wait_tensor`` is the identity.
Members that reach different collectives on one group, or ranks that wait on each
other in a cycle, raise instead of hanging, naming the ranks and nodes. With ``rng_states``
each rank draws its random numbers from its own CPU generator state, as a real process does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat as compat
from ..errors import SimulationError
from ..mesh import Mesh


def simulate_ranks(graph_modules: Sequence[torch.fx.GraphModule], inputs: Sequence[Sequence[Any]],
                   mesh: Mesh | None = None, rng_states: list[torch.Tensor] | None = None) -> list[Any]:
    """Run ``graph_modules[r](*inputs[r])`` for all ranks; returns each rank's outputs.

    ``mesh`` maps a collective's group name ``"adaptdist:<axis>"`` to the ranks of that axis's
    group; without it every collective spans all ranks (a 1-D mesh). ``rng_states`` (one
    ``torch.get_rng_state()`` per rank, None: all ranks share the process's generator) is each rank's CPU
    generator state: rank r's random ops draw from it, and it is updated in place (the list's tensors
    replaced) to the state rank r ends with; the process's own generator is left as it was.

    Raises:
        SimulationError: members of a group reach different collectives, or no rank can
            proceed (a hang in a real run); names the ranks and nodes.
    """
    n = len(graph_modules)
    if mesh is not None and mesh.world_size != n:
        raise SimulationError(f"mesh {mesh} has {mesh.world_size} ranks but {n} programs were given")
    coll_ops = {compat.functional_all_reduce_op(): "all_reduce", compat.functional_all_gather_op(): "all_gather",
                compat.functional_reduce_scatter_op(): "reduce_scatter",
                compat.functional_all_to_all_op(): "all_to_all"}
    wait = compat.functional_wait_op()

    def members(group: str, rank: int) -> tuple[int, ...]:
        if mesh is None:
            return tuple(range(n))
        return mesh.group(group.removeprefix("adaptdist:"), rank)

    nodes = [list(gm.graph.nodes) for gm in graph_modules]
    pcs = [0] * n
    envs: list[dict[torch.fx.Node, Any]] = [{} for _ in range(n)]
    arg_iters = [iter(a) for a in inputs]
    results: list[Any] = [None] * n
    done = [False] * n

    states = list(rng_states) if rng_states is not None else None
    if states is not None and len(states) != n:
        raise SimulationError(f"{len(states)} RNG states were given for {n} ranks")
    own_state = torch.get_rng_state() if states is not None else None

    def run_until_collective(r: int) -> None:
        if states is None:
            return _run_until_collective(r)
        torch.set_rng_state(states[r])
        try:
            _run_until_collective(r)
        finally:
            states[r] = torch.get_rng_state()

    def _run_until_collective(r: int) -> None:
        env = envs[r]
        while not done[r]:
            node = nodes[r][pcs[r]]
            if node.op == "call_function" and node.target in coll_ops:
                return
            if node.op == "placeholder":
                env[node] = next(arg_iters[r])
            elif node.op == "get_attr":
                env[node] = getattr(graph_modules[r], node.target)
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = args[0] if node.target is wait else node.target(*args, **kwargs)
            elif node.op == "output":
                results[r] = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                done[r] = True
                return
            else:
                raise SimulationError(f"rank {r}: unsupported node kind {node.op} at {node.name}")
            pcs[r] += 1

    while not all(done):
        for r in range(n):
            run_until_collective(r)
        progressed = False
        for r in range(n):
            if done[r]:
                continue
            node = nodes[r][pcs[r]]
            if node.op != "call_function" or node.target not in coll_ops:
                continue  # moved on in this round; it runs to its next collective in the next one
            group = str(node.args[-1])
            ranks = members(group, r)
            if r != ranks[0]:
                continue  # the group's first member carries it out
            at = {m: nodes[m][pcs[m]] for m in ranks if not done[m]}
            if len(at) != len(ranks) or any(str(x.args[-1]) != group for x in at.values()):
                continue  # some member is elsewhere (maybe on another group); retry after others move
            kinds = {m: coll_ops[x.target] for m, x in at.items()}
            if len(set(kinds.values())) != 1:
                raise SimulationError(f"ranks {list(ranks)} of group {group} reach different collectives: "
                                      + ", ".join(f"rank {m} {k} at {at[m].name}" for m, k in kinds.items()))
            _carry_out(kinds[r], [envs[m][at[m].args[0]] for m in ranks], at, ranks, envs, group)
            for m in ranks:
                pcs[m] += 1
            progressed = True
        if not progressed and not all(done):
            stuck = ", ".join(f"rank {r} at {nodes[r][pcs[r]].name} ({nodes[r][pcs[r]].args[-1]})"
                              for r in range(n) if not done[r])
            raise SimulationError(f"no rank can proceed (a real run would hang): {stuck}")
    if states is not None:
        torch.set_rng_state(own_state)
        rng_states[:] = states
    return results


def _carry_out(kind: str, vals: list[torch.Tensor], at: dict, ranks: tuple[int, ...], envs: list[dict],
               group: str) -> None:
    first = at[ranks[0]]
    if kind == "all_reduce":
        op = first.args[1]
        stacked = torch.stack(vals)
        total = stacked.amax(0) if op == "max" else stacked.amin(0) if op == "min" else stacked.sum(0)
        out = [total.clone() for _ in ranks]
    elif kind == "all_to_all":
        splits = [list(at[m].args[2]) for m in ranks]  # input split sizes (rows of dim 0) per member
        pieces = [list(v.split(s)) for v, s in zip(vals, splits)]
        out = [torch.cat([pieces[s][d] for s in range(len(ranks))]) for d in range(len(ranks))]
    elif kind == "reduce_scatter":
        if len({tuple(v.shape) for v in vals}) != 1 or vals[0].shape[0] % len(ranks):
            raise SimulationError(f"reduce_scatter at {first.name} on {group}: shapes {[tuple(v.shape) for v in vals]} "
                                  f"are unequal or not divisible by {len(ranks)} ranks")
        out = [b.clone() for b in torch.stack(vals).sum(0).chunk(len(ranks))]
    else:
        if len({tuple(v.shape) for v in vals}) != 1:
            raise SimulationError(f"all_gather at {first.name} on {group}: ranks pass different shapes "
                                  f"{[tuple(v.shape) for v in vals]}")
        total = torch.cat(vals)
        out = [total.clone() for _ in ranks]
    for m, o in zip(ranks, out):
        envs[m][at[m]] = o


