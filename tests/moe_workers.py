"""Workers of tests/test_moe.py's real gloo runs: MoE models through the torch.compile backend."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import adaptdist
from adaptdist.annotations import ManualPlan
from adaptdist.models import moe
from backend_workers import full_grad, rank_rows

# ops that move or reshape a value without computing from it: an all_gather reached through them gathers the value
_MOVES = ("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "clone", "constant_pad_nd", "cat", "flatten",
          "contiguous", "_to_copy", "expand", "slice", "detach", "alias", "getitem", "split", "split_with_sizes")


def gathered_params(program) -> list[str]:
    """Fqns of the parameters whose values an all_gather of the rank ``program`` moves (found by walking back
    from each all_gather's input through ops that only move data, to the program's placeholders)."""
    from adaptdist import graph_meta as gmeta

    out = set()
    for n in program.graph_module.graph.nodes:
        if n.op != "call_function" or "all_gather" not in str(n.target):
            continue
        todo = [a for a in n.all_input_nodes]
        while todo:
            a = todo.pop()
            if a.op == "placeholder":
                if gmeta.get_role(a) == "param":
                    out.add(gmeta.get_fqn(a))
            elif a.op == "call_function" and getattr(a.target, "__name__", str(a.target)).split(".")[0] in _MOVES:
                todo.extend(a.all_input_nodes)
    return sorted(out)


def starve_last_expert(model) -> None:
    """Push the router's logit of the last expert far down (and the tokens' features positive), so that no token
    picks it: its gradients are exactly zero in eager (tests/test_moe.py)."""
    with torch.no_grad():
        gate = model.moe.router.gate.weight
        gate[-1] = -50 * gate[:-1].abs().sum(0)
        model.inp.weight.abs_()
        model.inp.bias.fill_(1.0)


def moe_backend_worker(cases: list[dict], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    """Each case (``form``: moe.factory keywords, ``plan``: auto|dp|fsdp|ep) for ``steps`` SGD steps through
    ``torch.compile(model, backend=adaptdist.backend(plan=...))``, each rank passing its rows of the global
    batch; per case the losses, full gradients, final full parameters, meshes and graph-break warnings, or
    ``{"error": message}`` for a case that raised."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        out = []
        for case in cases:
            torch._dynamo.reset()
            model, batch, loss_fn = moe.factory(case["batch"], **case["form"])
            if case.get("dead_expert"):
                starve_last_expert(model)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            plan = ManualPlan.parse("ep", moe) if case["plan"] == "ep-module" else case["plan"]  # "ep": EP_PLAN found
            be = adaptdist.backend(plan=plan)
            compiled = torch.compile(model, backend=be)
            losses, grads = [], []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    for _ in range(steps):
                        x, y = (rank_rows(t, rank, world) for t in batch)
                        loss = loss_fn(compiled(x), y)
                        loss.backward()
                        losses.append(loss.item())
                        grads.append({n: full_grad(p) for n, p in model.named_parameters()})
                        opt.step()
                        opt.zero_grad()
                except Exception as e:  # a case expected to be refused: its message, the same on every rank
                    out.append({"error": f"{type(e).__name__}: {e}"})
                    continue
            out.append({"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled),
                        "meshes": [s.mesh for s in be.compiled], "collectives": [s.collectives() for s in be.compiled],
                        "gathered": [gathered_params(s.program) for s in be.compiled],
                        "placements": [getattr(p, "_adaptdist_layout", None) is not None for p in model.parameters()],
                        "local_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
                        "warnings": [str(w.message) for w in caught]})
        return out
    finally:
        dist.destroy_process_group()
