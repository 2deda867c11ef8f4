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
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            plan = ManualPlan.parse("ep", moe) if case["plan"] == "ep" else case["plan"]
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
                        "placements": [getattr(p, "_adaptdist_layout", None) is not None for p in model.parameters()],
                        "warnings": [str(w.message) for w in caught]})
        return out
    finally:
        dist.destroy_process_group()
