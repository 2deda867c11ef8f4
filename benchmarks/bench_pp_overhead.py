"""The pipeline executor's host overhead per microbatch, measured in CPU time (robust to a loaded machine).

For each schedule and microbatch count on ``--nproc`` gloo ranks, ``WideMLP`` (:mod:`bench_pp_bubble`'s model) is
lowered to pipeline programs and run by ``PipelineStepRunner`` with a trace whose clock is the main thread's CPU
time (``time.thread_time``): a span's length is CPU spent in it, descheduling and blocked waits cost (almost)
nothing. Per step and rank (medians over the measured steps):

- ``step``: the step's main-thread CPU;
- ``stage programs``: CPU inside the F, B, I, W spans (the stage programs: their ops' dispatch and arithmetic);
- ``executor``: the rest of the schedule: posting sends and receives, waiting (CPU only), slicing the
  microbatches, the bookkeeping of the action loop, the trace's own recording;
- ``sync+opt``: the gradient all-reduce, the loss all-reduce and the optimizer (once per step);
- ``per mb``: ``executor / (m * stages per rank)``: the host time one microbatch costs one stage beyond its stage
  programs, which the planner's per-microbatch stage time (op dispatch, ``StageEstimate.per_microbatch``) does not
  include;
- ``untraced``: the step's main-thread CPU with the trace off (``adaptdist train`` without ``--trace``), and
  ``per mb untraced``: ``(untraced - stage programs - sync+opt) / (m * stages per rank)`` (the trace's own
  recording left out; the stage programs and the tail taken from the traced steps).

With a tiny model (the default, ``--width 16``) the stage programs' CPU is their op dispatch; with ``--width 1024
--rows 512`` (bench_pp_bubble's) the executor's share of a real step shows. Outside CI::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_pp_overhead.py [--width 16] [--rows 64] [--layers 8]
        [--microbatches 4,8] [--steps 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb")


def worker(cfg: dict) -> dict:
    from safetensors.torch import load_file

    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.runtime.trace import TraceRecorder
    from adaptdist.runtime.worker import make_optimizer
    from adaptdist.stage_program_io import load_pipeline_program

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        t = load_file(cfg["batch_file"])
        batch = (t["b0"], t["b1"])
        out = {}
        for name, d in cfg["dirs"].items():
            program = load_pipeline_program(d, rank, world_size=world)
            runner = PipelineStepRunner(program, "sgd", 1e-3, setup_pipeline_groups(program, cfg["timeout_s"]),
                                        timeout_s=cfg["timeout_s"], make_optimizer=make_optimizer)
            rec = TraceRecorder(rank, clock=time.thread_time)
            runner.use_trace(rec)
            for step in range(cfg["warmup"] + cfg["steps"]):
                dist.barrier()
                with rec.step(step):
                    runner.step(batch)
            rows = []
            for st in rec.steps[cfg["warmup"]:]:
                inside = [s for s in rec.spans if s.step == st.step]
                compute = sum(s.duration_s for s in inside if s.kind in ("F", "B", "I", "W"))
                sched_end = max(s.end_s for s in inside if s.kind in ("F", "B", "I", "W", "send", "recv")
                                or (s.kind == "wait" and s.args.get("on") in ("send", "recv")))
                tail = st.end_s - sched_end  # gradient and loss all-reduces, optimizer
                rows.append((st.duration_s, compute, st.duration_s - compute - tail, tail))
            # the same steps untraced (adaptdist train without --trace): main-thread CPU per step
            runner.use_trace(TraceRecorder(rank, enabled=False))
            untraced = []
            for _ in range(cfg["steps"]):
                dist.barrier()
                c0 = time.thread_time()
                runner.step(batch)
                untraced.append(time.thread_time() - c0)
            out[name] = [statistics.median(r[i] for r in rows) for i in range(4)] + [statistics.median(untraced)]
        return out
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    from safetensors.torch import save_file

    from bench_pp_bubble import build
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.pipeline_schedules import stages_per_rank
    from adaptdist.runtime.launch import launch_local
    from adaptdist.stage_program_io import save_pipeline_programs

    load_before = os.getloadavg()
    p = args.nproc
    with tempfile.TemporaryDirectory(prefix="bench-pp-overhead-") as tmp:
        tmp = Path(tmp)
        model, batch, loss_fn = build(args.rows, args.width, args.layers)
        dirs, meta = {}, {}
        for m in [int(x) for x in args.microbatches.split(",")]:
            for s in args.schedules.split(","):
                v = stages_per_rank(s)
                name = f"{s} m={m}"
                programs = compile_model(model, batch, loss_fn, p, None, LoweringOptions(),
                                         pipeline=PipelineOptions(stages=p * v, microbatches=m, schedule=s,
                                                                  stages_per_rank=v))
                dirs[name] = str(save_pipeline_programs(programs, tmp / name.replace(" ", "_").replace("=", "")))
                meta[name] = (s, m, v)
        save_file({"b0": batch[0].contiguous(), "b1": batch[1].contiguous()}, str(tmp / "batch.safetensors"))
        cfg = dict(dirs=dirs, batch_file=str(tmp / "batch.safetensors"), warmup=args.warmup, steps=args.steps,
                   timeout_s=args.timeout_s)
        res = launch_local(worker, (cfg,), p)
    load_after = os.getloadavg()
    model_name = f"WideMLP: {args.layers} x Linear({args.width}, {args.width}) + ReLU, {args.rows} rows"
    print(f"{model_name}; {p} gloo ranks, 1 thread each; main-thread CPU ms per step (medians of {args.steps})")
    print(f"{'schedule':18} {'m':>2} {'rank':>4} {'step':>7} {'stage programs':>14} {'executor':>8} {'sync+opt':>8} "
          f"{'per mb':>7} {'untraced':>8} {'per mb untraced':>15}")
    out = {"model": model_name, "nproc": p, "load_average_before_after": [round(load_before[0], 2),
                                                                           round(load_after[0], 2)], "configs": {}}
    per_mb = []
    for name, (s, m, v) in meta.items():
        for r in range(p):
            step, comp, execu, tail, bare = res[r][name]
            bare_mb = max(0.0, bare - comp - tail) / (m * v)
            per_mb.append(bare_mb)
            out["configs"].setdefault(name, {})[r] = {"step_cpu_ms": 1e3 * step, "stage_programs_cpu_ms": 1e3 * comp,
                                                      "executor_cpu_ms": 1e3 * execu, "sync_opt_cpu_ms": 1e3 * tail,
                                                      "executor_cpu_ms_per_microbatch_stage": 1e3 * execu / (m * v),
                                                      "untraced_step_cpu_ms": 1e3 * bare,
                                                      "untraced_executor_cpu_ms_per_microbatch_stage": 1e3 * bare_mb}
            print(f"{s:18} {m:2d} {r:4d} {1e3 * step:7.2f} {1e3 * comp:14.2f} {1e3 * execu:8.2f} {1e3 * tail:8.2f} "
                  f"{1e3 * execu / (m * v):7.3f} {1e3 * bare:8.2f} {1e3 * bare_mb:15.3f}")
    out["untraced_executor_cpu_ms_per_microbatch_stage_median"] = 1e3 * statistics.median(per_mb)
    print(f"executor CPU per microbatch and stage, untraced: median {1e3 * statistics.median(per_mb):.3f} ms "
          f"(range {1e3 * min(per_mb):.3f}-{1e3 * max(per_mb):.3f}); load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    raise SystemExit(main())
