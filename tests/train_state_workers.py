"""Worker functions for tests/test_train_state.py (importable by spawned processes)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from adaptdist.program import load_program
from adaptdist.runtime import checkpoint_store
from adaptdist.runtime.train_state import (_global_dicts, check_identical_replicas, load_train_state,
                                           save_train_state, state_shapes)
from adaptdist.runtime.worker import StepRunner, register_mesh_groups


def _full(program, runner, mesh) -> dict[str, torch.Tensor]:
    """The saver's whole state as single-process tensors: "model/<fqn>" and "optim/<fqn>/<key>" (collective)."""
    model, optim = _global_dicts(program, runner.state, runner.opt, mesh)
    out = {}
    for f in sorted(model):
        t = model[f]
        out[f"model/{f}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    for f in sorted(optim):
        for k, t in sorted(optim[f].items()):
            out[f"optim/{f}/{k}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def save_worker(cases: list[dict], timeout_s: float = 120.0) -> list[dict]:
    """Per case (program_dir, optimizer, lr, batches, steps, drop: params whose optimizer state is removed,
    root, name, async: save asynchronously and take a step before waiting for it): train, check replicas, save a
    checkpoint of step ``steps`` under ``root`` (prepare, save, barrier, commit) and, on rank 0, the full state
    as ``root/full.safetensors``. Returns each case's RNG state at the save and the seconds it took."""
    import time

    from safetensors.torch import save_file

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        out = []
        for c in cases:
            program = load_program(c["program_dir"], rank, world_size=dist.get_world_size())
            mesh = register_mesh_groups(program, "gloo")
            runner = StepRunner(program, c["optimizer"], c["lr"])
            for s in range(c["steps"]):
                runner.step(c["batches"][s % len(c["batches"])])
            for f in c.get("drop", ()):
                runner.opt.state.pop(runner.state[f], None)
            check_identical_replicas(program, runner.state, runner.opt, mesh)
            torch.manual_seed(1000 + rank)
            torch.rand(3)
            rng = torch.get_rng_state()
            tmp = [checkpoint_store.prepare(c["root"], c["steps"]) if rank == 0 else None]
            dist.broadcast_object_list(tmp, src=0)
            full = _full(program, runner, mesh)  # the state saved
            t0 = time.perf_counter()
            if c.get("async"):  # the next step changes the state while DCP writes the staged copy
                fut = save_train_state(tmp[0], program, runner.state, runner.opt, mesh, rank, async_=True)
                runner.step(c["batches"][0])
                fut.result(timeout_s=60)
            else:
                save_train_state(tmp[0], program, runner.state, runner.opt, mesh, rank)
            dist.barrier()
            save_s = time.perf_counter() - t0
            if rank == 0:
                save_file(full, os.path.join(c["root"], "full.safetensors"))
                checkpoint_store.commit(tmp[0], {"step": c["steps"], "model": c["name"],
                                                 "state_shapes": state_shapes(program)})
            dist.barrier()
            out.append({"rng": rng, "save_s": save_s})
        return out
    finally:
        dist.destroy_process_group()


def load_worker(cases: list[dict], timeout_s: float = 120.0) -> list[dict]:
    """Per case (program_dir, optimizer, lr, checkpoint: a step directory or None (no load), prefill: one step
    before loading so the optimizer already has state, batches, steps after loading, name): load, check
    replicas, then train ``steps`` more. Returns the state and optimizer state right after the load (this
    rank's shards), the RNG state after it, and the parameters after the further steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        out = []
        for c in cases:
            program = load_program(c["program_dir"], rank, world_size=dist.get_world_size())
            mesh = register_mesh_groups(program, "gloo")
            runner = StepRunner(program, c["optimizer"], c["lr"])
            if c.get("prefill"):
                runner.step(c["batches"][-1])
            torch.manual_seed(777)
            if c["checkpoint"] is not None:
                load_train_state(c["checkpoint"], program, runner.state, runner.opt, mesh, rank, restore_rng=True,
                                 model=c["name"])
            rng = torch.get_rng_state()
            check_identical_replicas(program, runner.state, runner.opt, mesh)
            state = {f: t.clone() for f, t in runner.state.items()}
            params = {f: p.clone() for f, p in zip(program.param_fqns, runner.params)}  # what the optimizer holds
            optim = {f: {k: v.clone() for k, v in runner.opt.state[p].items()}
                     for f, p in zip(program.param_fqns, runner.params) if runner.opt.state.get(p)}
            refused = None
            if c.get("corrupt_rank") is not None:  # one replica off by one ulp: every rank must refuse
                if rank == c["corrupt_rank"]:
                    with torch.no_grad():
                        t = runner.state["fc2.bias"]
                        t[0] = torch.nextafter(t[0], t[0] + 1)
                try:
                    check_identical_replicas(program, runner.state, runner.opt, mesh)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    refused = f"{type(e).__name__}: {e}"
            losses = [runner.step(c["batches"][s % len(c["batches"])]) for s in range(c.get("steps", 0))]
            after = {f: runner.state[f].clone() for f in program.param_fqns}
            out.append({"state": state, "params": params, "optim": optim, "rng": rng, "losses": losses,
                        "refused": refused, "after": after})
        return out
    finally:
        dist.destroy_process_group()
