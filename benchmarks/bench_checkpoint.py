"""What a training-state checkpoint (``adaptdist.runtime.train_state``) costs the step loop.

Built-in GPT (default GPTConfig, 1.85 M parameters), AdamW, global batch 16 x 128, 2 ranks on gloo, 1 thread
per rank, plans ``dp`` and ``fsdp``. Per plan, one ``launch_local`` job: ``--warmup`` steps, then ``--steps``
plain steps (the baseline), then ``--reps`` times each of

- sync: ``checkpoint_store.prepare`` (rank 0), barrier, ``save_train_state``, barrier, ``commit`` (rank 0:
  meta.json, manifest of sha256, fsync, rename), barrier -- all of it blocks the loop;
- async: prepare, barrier, ``save_train_state(..., async_=True)`` (blocks: planning + staging to CPU), then
  steps go on while DCP writes in a thread; before the next step that follows the write, ``result()``,
  barrier, commit, barrier. Reported: the blocking part, the steps run while writing (their median time
  against the baseline) and the wait in ``result()`` + commit;
- load: ``load_train_state`` (verify + DCP read) of the last checkpoint onto the same program.

Times are the slowest rank's (max over ranks), in ms.

    .venv/bin/python benchmarks/bench_checkpoint.py [--nproc 2] [--plans dp,fsdp] [--steps 10] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def worker(cfg: dict) -> dict:
    from adaptdist.program import load_program
    from adaptdist.runtime import checkpoint_store
    from adaptdist.runtime.train_state import (checkpoint_process_group, load_train_state, save_train_state,
                                               state_shapes)
    from adaptdist.runtime.worker import StepRunner, register_mesh_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        rank = dist.get_rank()
        program = load_program(cfg["program_dir"], rank, world_size=dist.get_world_size())
        mesh = register_mesh_groups(program, "gloo")
        ckpt_group = checkpoint_process_group()
        runner = StepRunner(program, "adamw", 1e-3)
        batch = cfg["batch"]
        root = Path(cfg["root"])
        step_no = 0

        def step() -> float:
            nonlocal step_no
            t0 = time.perf_counter()
            runner.step(batch)
            step_no += 1
            return time.perf_counter() - t0

        def start() -> Path:
            tmp = [checkpoint_store.prepare(root, step_no) if rank == 0 else None]
            dist.broadcast_object_list(tmp, src=0)
            return Path(tmp[0])

        def finish(tmp: Path) -> None:
            dist.barrier()
            if rank == 0:
                checkpoint_store.commit(tmp, {"step": step_no, "state_shapes": state_shapes(program)}, keep=2)
            dist.barrier()

        for _ in range(cfg["warmup"]):
            step()
        base = [step() for _ in range(cfg["steps"])]
        out = {"base_s": base, "sync_s": [], "async_block_s": [], "async_steps_s": [], "async_wait_s": [],
               "load_s": [], "steps_during_write": []}
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            tmp = start()
            save_train_state(tmp, program, runner.state, runner.opt, mesh, rank)
            finish(tmp)
            out["sync_s"].append(time.perf_counter() - t0)
            step()
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            tmp = start()
            fut = save_train_state(tmp, program, runner.state, runner.opt, mesh, rank, async_=True,
                                   process_group=ckpt_group)
            out["async_block_s"].append(time.perf_counter() - t0)
            n = 0
            while True:  # the loop goes on while the write is in flight (the same number of steps on every rank)
                done = torch.tensor([int(fut.done())])
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
                if done.item() or n >= cfg["steps"]:
                    break
                out["async_steps_s"].append(step())
                n += 1
            out["steps_during_write"].append(n)
            t1 = time.perf_counter()
            fut.result()
            finish(tmp)
            out["async_wait_s"].append(time.perf_counter() - t1)
        last = checkpoint_store.latest_good(root)
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            load_train_state(last.path, program, runner.state, runner.opt, mesh, rank, restore_rng=False)
            dist.barrier()
            out["load_s"].append(time.perf_counter() - t0)
        out["bytes"] = sum(p.stat().st_size for p in last.path.rglob("*") if p.is_file())
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--plans", default="dp,fsdp")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.models.gpt import factory
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local

    model, batch, loss_fn = factory(args.batch_size, args.seq_len)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"built-in GPT, {nparams / 1e6:.2f} M parameters, AdamW, batch {args.batch_size} x {args.seq_len}, "
          f"{args.nproc} ranks (gloo, 1 thread each), torch {torch.__version__}")
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    print("| plan | step (ms) | sync save+commit (ms) | async: blocking (ms) | steps during write | their step "
          "(ms) | result()+commit (ms) | load (ms) | checkpoint (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for plan in args.plans.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            progs = compile_model(model, batch, loss_fn, args.nproc, ManualPlan.parse(plan))
            save_programs(progs, Path(tmp) / "programs")
            cfg = {"program_dir": str(Path(tmp) / "programs"), "root": str(Path(tmp) / "ckpt"), "batch": batch,
                   "warmup": args.warmup, "steps": args.steps, "reps": args.reps}
            res = launch_local(worker, (cfg,), args.nproc)
        worst = {k: [max(res[r][k][i] for r in res) for i in range(len(res[0][k]))]
                 for k in ("base_s", "sync_s", "async_block_s", "async_wait_s", "load_s")}
        during = [t for r in res for t in res[r]["async_steps_s"]]
        print(f"| {plan} | {ms(worst['base_s']):.1f} | {ms(worst['sync_s']):.1f} | {ms(worst['async_block_s']):.1f}"
              f" | {statistics.median(res[0]['steps_during_write'])} | {ms(during) if during else float('nan'):.1f}"
              f" | {ms(worst['async_wait_s']):.1f} | {ms(worst['load_s']):.1f} | {res[0]['bytes'] / 2**20:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent),
                                                os.environ.get("PYTHONPATH", "")])
    sys.exit(main())
