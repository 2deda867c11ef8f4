"""Where one training step's time goes under ``--comm shm`` and ``--comm gloo``: every collective the rank program
issues (op, bytes, when it is issued, how long the issuing call takes, how long its wait takes, how much of the
step runs between issue and wait), and the rest of the step (compute), for the same plan lowered on both
transports, measured interleaved in the same two processes (``benchmarks/interleave.py``'s method: a barrier
before each step, the order alternated).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_step_comm.py --plan fsdp|dp
        [--nproc 2] [--batch-size 4] [--seq-len 64] [--steps 12] [--warmup 2] [--bucket-mb 25]
        [--sides shm,gloo | shm:0,shm:1,gloo,DDP,no-comm,FSDP2] [--order alternate|rotate] [--no-instrument]

Per side it prints, from rank 0 (medians over the measured steps): the step, the time inside collective calls
(issue + wait), the rest, CPU seconds of the whole process per step (every thread), and a table with one row per
collective of the program. A diagnostic, not a benchmark with a target: figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

MIB = 2**20


def _instrument(program, log: list):
    """``program``'s step as a traced GraphModule whose collectives and waits append ``(node name, phase,
    perf_counter s)`` to ``log`` around each call; returns ``(gm, info)``, info: node name -> (op, bytes)."""
    import torch
    import torch.fx

    from adaptdist import _torch_compat as compat
    from adaptdist.comm_transport import is_shm_collective, is_shm_wait

    gm = torch.fx.symbolic_trace(program.module)
    info = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        kind = compat.functional_collective_kind(n.target)
        shm = kind is None and (is_shm_collective(n.target) or is_shm_wait(n.target))
        if kind is None and not shm:
            continue
        target = n.target
        name = n.name
        op = kind if kind is not None else str(target.name()).split("::")[-1]
        info[name] = op

        def timed(*args, _t=target, _name=name, **kwargs):
            t0 = time.perf_counter()
            out = _t(*args, **kwargs)
            t1 = time.perf_counter()
            nbytes = args[0].numel() * args[0].element_size() if isinstance(args[0], torch.Tensor) else 0
            log.append((_name, t0, t1, nbytes))
            return out

        timed.__name__ = timed.__qualname__ = f"timed_{name}"
        n.target = timed
    gm.recompile()
    return gm, info


def worker(cfg: dict) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from adaptdist.program import load_program
    from adaptdist.runtime.worker import StepRunner, register_mesh_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        sides, logs, infos, threads = {}, {}, {}, {}
        from adaptdist.comm_transport import shm_groups_in_code

        for side in cfg["sides"]:
            if side in ("no-comm", "DDP", "FSDP2"):  # bench_dp's / bench_fsdp's torch sides (step time only)
                import bench_dp
                import bench_fsdp

                step = {"no-comm": bench_dp.no_comm_step, "DDP": bench_dp.ddp_step,
                        "FSDP2": bench_fsdp.fsdp2_step}[side](cfg, rank, world)
                sides[side] = type("TorchSide", (), {"step": staticmethod(step)})
                logs[side], infos[side], threads[side] = [], {}, None
                continue
            comm, _, thread = side.partition(":")
            program = load_program(cfg["program_dirs"][comm], rank, world_size=world)
            register_mesh_groups(program, "gloo")
            runner = StepRunner(program, "adamw", 1e-3)
            logs[side] = []
            if cfg["instrument"]:
                gm, infos[side] = _instrument(program, logs[side])
                runner._run = gm
            else:
                infos[side] = {}
            sides[side] = runner
            threads[side] = (shm_groups_in_code(program.code), thread) if thread else None
        t = load_file(cfg["batch_file"])
        batch = tuple(t[f"b{i}"] for i in range(len(t)))
        out = {c: {"steps": []} for c in sides}
        names = list(sides)
        for i in range(cfg["warmup"] + cfg["steps"]):
            if cfg["order"] == "rotate":  # interleave.py's order: the first side rotates, every other block reversed
                k = i % len(names)
                order = names[k:] + names[:k]
                order = order[::-1] if (i // len(names)) % 2 else order
            else:
                order = names if i % 2 == 0 else names[::-1]
            for c in order:
                if threads[c] is not None:  # this side's comm-thread setting on the (shared) shm groups
                    for g in threads[c][0]:
                        torch.ops.adaptdist._shm_group_set_comm_thread(g, threads[c][1] == "1")
                dist.barrier()
                logs[c].clear()
                c0 = time.process_time()
                t0 = time.perf_counter()
                sides[c].step(batch)
                t1 = time.perf_counter()
                if i >= cfg["warmup"]:
                    out[c]["steps"].append({"t0": t0, "step_s": t1 - t0, "cpu_s": time.process_time() - c0,
                                            "calls": list(logs[c])})
        for c in sides:
            out[c]["info"] = infos[c]
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def report(res: dict, nproc: int) -> None:
    for comm in res[0]:
        info = res[0][comm]["info"]
        print(f"\n=== --comm {comm}")
        for r in range(nproc):
            steps = res[r][comm]["steps"]
            step = statistics.median(s["step_s"] for s in steps)
            inside = statistics.median(sum(t1 - t0 for _, t0, t1, _ in s["calls"]) for s in steps)
            cpu = statistics.median(s["cpu_s"] for s in steps)
            print(f"rank {r}: step {1e3 * step:7.2f} ms, inside collective calls {1e3 * inside:7.2f} ms, rest "
                  f"{1e3 * (step - inside):7.2f} ms, process CPU {1e3 * cpu:7.2f} ms/step, "
                  f"{len(steps[0]['calls'])} calls/step")
        steps = res[0][comm]["steps"]
        if not info:
            continue
        print("rank 0, per call (median over steps): node, op, input bytes, issued at (ms into the step), "
              "call ms")
        ncalls = len(steps[0]["calls"])
        for k in range(ncalls):
            name, _, _, nbytes = steps[0]["calls"][k]
            at = statistics.median(s["calls"][k][1] - s["t0"] for s in steps if len(s["calls"]) == ncalls)
            dur = statistics.median(s["calls"][k][2] - s["calls"][k][1] for s in steps if len(s["calls"]) == ncalls)
            print(f"  {name:40s} {info[name]:32s} {nbytes:>10d} {1e3 * at:8.2f} {1e3 * dur:8.3f}")
    names = list(res[0])
    for a in names:
        for b in names:
            if a < b:
                r = sorted(max(res[k][b]["steps"][i]["step_s"] for k in res) / max(res[k][a]["steps"][i]["step_s"]
                                                                                  for k in res)
                           for i in range(len(res[0][a]["steps"])))
                print(f"per-round speedup {a} over {b} (slowest rank): median {statistics.median(r):.3f}x, "
                      f"{a} faster in {sum(x > 1 for x in r)}/{len(r)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="fsdp")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=("alternate", "rotate"), default="alternate",
                    help="sides' order per round: forward then backward (alternate), or interleave.py's rotation")
    ap.add_argument("--no-instrument", action="store_true",
                    help="run the loaded programs as they are (step times only), to see what the timing wrappers cost")
    ap.add_argument("--sides", default="shm,gloo",
                    help="comma-separated: no-comm, DDP (bench_dp's), FSDP2 (bench_fsdp's), gloo, shm (comm thread as "
                         "init_group chose), shm:0 / shm:1 (comm thread off / on, switched before each of that side's "
                         "steps; the shm sides share one group)")
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from adaptdist.models import gpt
    from adaptdist.runtime.launch import launch_local
    from bench_fsdp import compile_and_save

    import profile_step_comm

    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="profile_step_comm-") as tmp:
        dirs = {}
        sides = args.sides.split(",")
        for c in sorted({x.partition(":")[0] for x in sides} - {"no-comm", "DDP", "FSDP2"}):
            dirs[c] = str(Path(tmp) / c)
            compile_and_save(args.plan, args.nproc, args.batch_size, args.seq_len, args.seed, Path(dirs[c]),
                             int(args.bucket_mb * MIB), comm=c)
        torch.manual_seed(args.seed)
        _, example, _ = gpt.factory(args.batch_size, args.seq_len)
        batch_file = str(Path(tmp) / "batch.safetensors")
        save_file({f"b{i}": t.contiguous() for i, t in enumerate(example)}, batch_file)
        cfg = {"order": args.order, "instrument": not args.no_instrument, "sides": sides, "program_dirs": dirs,
               "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": 1e-3, "bucket_mb": args.bucket_mb,
               "batch_file": batch_file, "steps": args.steps, "warmup": args.warmup}
        res = launch_local(profile_step_comm.worker, (cfg,), args.nproc)
    report(res, args.nproc)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
