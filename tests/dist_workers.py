"""Worker functions for multi-process tests (importable by spawned processes)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from adaptdist.program import load_program
from adaptdist.runtime.worker import StepRunner, register_mesh_groups


def dp_sgd_worker(program_dir: str, batches: list, lr: float, steps: int, timeout_s: float = 30.0) -> dict:
    """Run ``steps`` SGD steps of this rank's program; return losses, grads per step and final params."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        program = load_program(program_dir, rank, world_size=dist.get_world_size())
        register_mesh_groups(program, "gloo")
        runner = StepRunner(program, "sgd", lr)
        losses, grads = [], []
        for s in range(steps):
            losses.append(runner.step(batches[s % len(batches)]))
            grads.append({k: v.clone() for k, v in runner.last_grads.items()})
        params = {f: runner.state[f].clone() for f in program.param_fqns}
        return {"losses": losses, "grads": grads, "params": params, "rows": program.batch_slice}
    finally:
        dist.destroy_process_group()


def multi_case_sgd_worker(cases: list[tuple[str, list, float | None]], lr: float, steps: int,
                          timeout_s: float = 60.0) -> list[dict]:
    """Run several compiled cases in one process group (each: program dir, batches, max grad norm):
    ``steps`` SGD steps each; returns per case the losses, grads per step and final params."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        out = []
        for program_dir, batches, max_norm in cases:
            program = load_program(program_dir, rank, world_size=dist.get_world_size())
            register_mesh_groups(program, "gloo")
            runner = StepRunner(program, "sgd", lr, max_grad_norm=max_norm)
            losses, grads, norms = [], [], []
            for s in range(steps):
                losses.append(runner.step(batches[s % len(batches)]))
                grads.append({k: v.clone() for k, v in runner.last_grads.items()})
                norms.append(runner.last_grad_norm)
            params = {f: runner.state[f].clone() for f in program.param_fqns}
            out.append({"losses": losses, "grads": grads, "params": params, "norms": norms})
        return out
    finally:
        dist.destroy_process_group()


def collective_edge_cases_worker(timeout_s: float = 30.0) -> dict:
    """Functional collectives on non-contiguous and zero-element tensors; returns what each produced."""
    from adaptdist import _torch_compat as compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        compat.register_process_group("adaptdist:test", dist.group.WORLD)
        wait = compat.functional_wait_op()
        base = torch.arange(12.0).view(3, 4) + 100 * rank
        nc = base.t()  # non-contiguous [4, 3]
        out = {
            "all_reduce_nc": wait(compat.functional_all_reduce_op()(nc, "sum", "adaptdist:test")),
            "all_gather_nc": wait(compat.functional_all_gather_op()(nc, world, "adaptdist:test")),
            "reduce_scatter_nc": wait(compat.functional_reduce_scatter_op()(
                torch.arange(4.0 * world).view(world, 4).t().contiguous().t() + rank, "sum", world, "adaptdist:test")),
            "all_reduce_empty": wait(compat.functional_all_reduce_op()(torch.empty(0, 3), "sum", "adaptdist:test")),
            "all_gather_empty": wait(compat.functional_all_gather_op()(torch.empty(0, 3), world, "adaptdist:test")),
        }
        return {k: v.clone() for k, v in out.items()}
    finally:
        dist.destroy_process_group()


def checkpoint_worker(program_dir: str, out_dir: str, batch: tuple, timeout_s: float = 60.0) -> dict:
    """One AdamW step of this rank's program, then its checkpoint as the step loop writes it (``worker._save``:
    ``out_dir/checkpoints/step-00000001`` with the DCP of model and optimizer state; ``worker._write_weights``:
    model.safetensors on rank 0); returns the shards this rank holds."""
    from types import SimpleNamespace

    from adaptdist.runtime.worker import _save, _write_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        program = load_program(program_dir, rank, world_size=dist.get_world_size())
        mesh = register_mesh_groups(program, "gloo")
        runner = StepRunner(program, "adamw", 0.1)
        runner.step(batch)
        cfg = SimpleNamespace(out_dir=out_dir, model_name="test", keep=None, run_meta={}, seed=0)
        _save(cfg, runner, program, mesh, rank, dist.get_world_size(), 1, [])
        _write_weights(cfg, runner, rank, mesh)
        optim = runner.optimizer_state_by_fqn()
        return {"state": {f: t.clone() for f, t in runner.state.items()},
                "exp_avg": {f: optim[f]["exp_avg"].clone() for f in program.param_fqns}}
    finally:
        dist.destroy_process_group()
