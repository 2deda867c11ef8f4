"""What a training-state checkpoint (``adaptdist.runtime.train_state``) costs the step loop.

Built-in GPT (default GPTConfig, 1.85 M parameters), AdamW, global batch 16 x 128, 2 ranks on gloo, 1 thread
per rank, plans ``dp`` and ``fsdp``. Per plan, one ``launch_local`` job: ``--warmup`` steps, then ``--reps``
repetitions (interleaved, the order rotating, since the machine's load drifts) of three windows of
``--window`` steps each, with the cost of a checkpoint = the window's time minus the plain window's:

- plain: no checkpoint;
- sync: after the first step, ``checkpoint_store.prepare`` (rank 0), barrier, ``save_train_state``, barrier,
  ``commit`` (rank 0: meta.json, manifest of sha256, fsync, rename), barrier -- all of it blocks the loop;
- async: after the first step, prepare, barrier, ``save_train_state(..., async_=True)`` (blocks: staging to
  CPU), then steps go on while DCP plans and writes in a thread (on a process group of its own); after the
  step in which the write finished on every rank, ``result()``, barrier, commit, barrier.
- load: ``checkpoint_store.verify`` (sha256 of every file, on every rank), then ``load_train_state(...,
  verify=False)`` (DCP read into this program's shards) of the last checkpoint onto the same program.

Times are the slowest rank's (max over ranks), in ms.

    .venv/bin/python benchmarks/bench_checkpoint.py [--nproc 2] [--plans dp,fsdp] [--window 4] [--reps 6]
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
        out = {k: [] for k in ("plain_s", "sync_s", "async_s", "sync_save_s", "commit_s", "async_block_s",
                               "async_wait_s", "load_s", "verify_s", "steps_during_write")}

        def window(kind: str) -> float:
            """``cfg["window"]`` steps with (sync/async) or without (plain) one checkpoint after the first; its
            seconds. An async write is waited for (result, barrier, commit) after the step in which it finished
            (the same step on every rank), or at the window's end."""
            dist.barrier()
            t0 = time.perf_counter()
            step()
            fut = tmp = None
            if kind == "sync":
                tmp = start()
                t1 = time.perf_counter()
                save_train_state(tmp, program, runner.state, runner.opt, mesh, rank)
                dist.barrier()
                t2 = time.perf_counter()
                finish(tmp)
                out["sync_save_s"].append(t2 - t1)
                out["commit_s"].append(time.perf_counter() - t2)
            elif kind == "async":
                tmp = start()
                t1 = time.perf_counter()
                fut = save_train_state(tmp, program, runner.state, runner.opt, mesh, rank, async_=True,
                                       process_group=ckpt_group)
                out["async_block_s"].append(time.perf_counter() - t1)
            n = 0
            for _ in range(cfg["window"] - 1):
                step()
                n += 1
                if fut is not None:
                    done = torch.tensor([int(fut.done())])
                    dist.all_reduce(done, op=dist.ReduceOp.MIN)
                    if done.item():
                        break
            if fut is not None:
                out["steps_during_write"].append(n)
                t1 = time.perf_counter()
                fut.result()
                finish(tmp)
                out["async_wait_s"].append(time.perf_counter() - t1)
                for _ in range(cfg["window"] - 1 - n):
                    step()
            dist.barrier()
            return time.perf_counter() - t0

        for i in range(cfg["reps"]):  # interleaved, the order rotating: the machine's load drifts
            kinds = ["plain", "sync", "async"]
            for kind in kinds[i % 3:] + kinds[:i % 3]:
                out[f"{kind}_s"].append(window(kind))
        last = checkpoint_store.latest_good(root)
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            checkpoint_store.verify(last.path)  # every rank checks the checksums (as load_train_state does)
            dist.barrier()
            out["verify_s"].append(time.perf_counter() - t0)
            load_train_state(last.path, program, runner.state, runner.opt, mesh, rank, restore_rng=False,
                             verify=False)
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
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
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
    print("| plan | window of W steps (ms) | + sync checkpoint (ms) | + async checkpoint (ms) | sync: save (ms) | "
          "commit (ms) | async: blocking (ms) | steps during write | result()+commit (ms) | load (ms) | "
          "of which verify (ms) | checkpoint (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for plan in args.plans.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            progs = compile_model(model, batch, loss_fn, args.nproc, ManualPlan.parse(plan))
            save_programs(progs, Path(tmp) / "programs")
            cfg = {"program_dir": str(Path(tmp) / "programs"), "root": str(Path(tmp) / "ckpt"), "batch": batch,
                   "warmup": args.warmup, "window": args.window, "reps": args.reps}
            res = launch_local(worker, (cfg,), args.nproc)
        worst = {k: [max(res[r][k][i] for r in res) for i in range(len(res[0][k]))]
                 for k in res[0] if k.endswith("_s")}
        extra = {k: [w - p for w, p in zip(worst[f"{k}_s"], worst["plain_s"])] for k in ("sync", "async")}
        print(f"| {plan} | {ms(worst['plain_s']):.0f} | {ms(extra['sync']):+.0f} | {ms(extra['async']):+.0f} "
              f"| {ms(worst['sync_save_s']):.0f} | {ms(worst['commit_s']):.0f} | {ms(worst['async_block_s']):.0f} "
              f"| {statistics.median(res[0]['steps_during_write'])} | {ms(worst['async_wait_s']):.0f} "
              f"| {ms(worst['load_s']):.0f} | {ms(worst['verify_s']):.0f} | {res[0]['bytes'] / 2**20:.1f} |",
              flush=True)
    print(f"(W = {args.window}; medians over {args.reps} interleaved repetitions; '+': the window's time minus the "
          "plain window's of the same repetition)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent),
                                                os.environ.get("PYTHONPATH", "")])
    sys.exit(main())
