"""The pipeline bubble, measured: idle fraction per rank of each schedule vs the formula's and the simulated one.

For each schedule (gpipe, 1f1b, interleaved-1f1b, zb) and microbatch count (``--microbatches 4,8``) on ``--nproc``
gloo ranks (one stage per rank; interleaved: two), a compute-dominated model (``WideMLP``: ``--layers`` x
Linear(width, width) + ReLU, MSE loss, SGD; the activations a stage sends are ``rows/m x width`` floats) is lowered
to pipeline programs (``compile_model(..., pipeline=PipelineOptions(...))``, what ``adaptdist train --plan pp
--schedule S --microbatches M`` runs) and every configuration runs in ONE process group, blocks of steps
alternating (A B C ..., then reversed), so all see the same machine load. Each rank records the real timeline
(``PipelineStepRunner.use_trace``: the spans of ``adaptdist train --trace``); the first ``--warmup`` steps of each
configuration are dropped. Printed per configuration and rank:

- ``measured``: the trace's idle fraction (``Trace.window(steps).idle_fractions()``: idle over the step window, the
  optimizer and the loss all-reduce inside the window);
- ``sched``: the same over the schedule's span only (the first F to the last B/W of any rank in the step): what
  the formulas describe;
- ``formula``: ``cost_models.pipeline.schedule_estimate`` fed with the measured per-microbatch F, B (I) and W
  times of each rank (medians over the measured steps): ``1 - m t_r / T``;
- ``sim``: ``pipeline_schedules.simulate_timeline`` of the schedule's real action lists with the same times
  (equal stages: the median over ranks; messages free): ``1 - busy_r / T``;
- ``ideal``: the formula with F = I = W on equal stages (``(p-1)/(m+p-1)`` for GPipe/1F1B);
- ``p2p wait ms``: per step, the time the rank was blocked waiting for a send or a receive (the executor's ``wait``
  spans); ``idle ms``: ``measured`` times the step.

``--p2p posted,blocking`` runs every configuration twice in the same process group, blocks alternating: with the
executor's posted sends and receives (``isend``/``irecv``, receives waited for right before their use, sends at the
step's end) and with each send and receive waited for at its place in the list (the executor before that change):
a before/after under the same machine load.

Outside CI::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_pp_bubble.py [--nproc 2] [--microbatches 4,8] [--width 1024]
        [--layers 8] [--rows 256] [--steps 4] [--reps 2] [--warmup 1] [--p2p posted,blocking]
        [--json FILE] [--save-traces DIR]
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
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb")


class WideMLP(nn.Module):
    """``layers`` x (Linear(width, width) + ReLU)."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
        return x


def build(rows: int, width: int, layers: int):
    torch.manual_seed(0)
    model = WideMLP(width, layers)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)), F.mse_loss


# --------------------------------------------------------------------------- worker (one per rank)

def blocking_runner_class():
    """``PipelineStepRunner`` with the point-to-point semantics it had before posted sends and receives (up to
    commit b091288): each send and each receive waited for at its own place in the action list (the "before" of
    ``--p2p posted,blocking``, measured in the same process group as the "after")."""
    from adaptdist.runtime.pipeline_executor import PipelineStepRunner

    class BlockingP2PStepRunner(PipelineStepRunner):
        def _post_sends(self, tensors, routes, peer, a, backward, pending):
            mine: list = []
            super()._post_sends(tensors, routes, peer, a, backward, mine)
            self._wait_sends(mine)

        def _post_recvs(self, specs, routes, peer, a, backward, stage):
            return self._take({0: super()._post_recvs(specs, routes, peer, a, backward, stage)}, 0)

    return BlockingP2PStepRunner


def worker(cfg: dict) -> dict:
    from safetensors.torch import load_file

    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.stage_program_io import load_pipeline_program
    from adaptdist.runtime.trace import TraceRecorder
    from adaptdist.runtime.worker import make_optimizer

    torch.set_num_threads(cfg["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        t = load_file(cfg["batch_file"])
        batch = (t["b0"], t["b1"])
        runners, recs, counts = {}, {}, {}
        for name, d in cfg["dirs"].items():
            program = load_pipeline_program(d, rank, world_size=world)
            groups = setup_pipeline_groups(program, cfg["timeout_s"])
            cls = blocking_runner_class() if cfg["p2p"][name] == "blocking" else PipelineStepRunner
            runners[name] = cls(program, "sgd", 1e-3, groups, timeout_s=cfg["timeout_s"],
                                make_optimizer=make_optimizer)
            recs[name] = TraceRecorder(rank)
            runners[name].use_trace(recs[name])
            recs[name].align_clocks()
            counts[name] = 0
        names = list(cfg["dirs"])
        total = cfg["warmup"] + cfg["steps"] * cfg["reps"]
        for rep in range(cfg["reps"]):
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                n = cfg["steps"] + (cfg["warmup"] if rep == 0 else 0)
                for _ in range(n):
                    dist.barrier()
                    with recs[name].step(counts[name]):
                        runners[name].step(batch)
                    counts[name] += 1
        assert all(c == total for c in counts.values()), counts
        # one activation message alone (rank 0 <-> 1 ping-pong, blocking as the executor's): its one-way time
        one_way = {}
        for m in sorted(set(cfg["microbatches"])):
            buf = torch.zeros(cfg["rows"] // m, cfg["width"])
            ts = []
            for _ in range(10):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                ts.append((time.perf_counter() - t0) / 2)
            one_way[m] = statistics.median(ts)
        return {"traces": {name: rec.to_dict() for name, rec in recs.items()}, "one_way_s": one_way}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- analysis

def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def analyse(trace, schedule: str, p: int, m: int, v: int) -> dict:
    from adaptdist.cost_models.pipeline import schedule_estimate
    from adaptdist.pipeline_schedules import pipeline_order, simulate_timeline

    measured = trace.idle_fractions()
    steps = sorted({s.step for s in trace.steps})
    # idle over the schedule's span only (first F to last B/W of any rank), per rank
    sched_idle = {r: [] for r in trace.ranks}
    for st in steps:
        comp = [s for s in trace.spans if s.step == st and s.kind in ("F", "B", "I", "W")]
        t0, t1 = min(s.start_s for s in comp), max(s.end_s for s in comp)
        for r in trace.ranks:
            busy = sum(b - a for a, b in _union([(s.start_s, s.end_s) for s in comp if s.rank == r]))
            sched_idle[r].append(1.0 - busy / (t1 - t0))
    sched = {r: statistics.mean(x) for r, x in sched_idle.items()}
    # measured per-microbatch times per rank (a rank's v chunks summed) and per chunk
    per = {}
    for r in trace.ranks:
        d = {}
        for k in ("F", "B", "I", "W"):
            xs = [s.duration_s for s in trace.spans if s.rank == r and s.kind == k]
            d[k] = statistics.median(xs) if xs else 0.0
        if d["B"] == 0.0:   # zb: B = I + W
            d["B"] = d["I"] + d["W"]
        per[r] = d
    f_r = [v * per[r]["F"] for r in trace.ranks]
    if schedule == "zb":
        b_r = [v * per[r]["I"] for r in trace.ranks]
        w_r = [v * per[r]["W"] for r in trace.ranks]
    else:
        b_r = [v * per[r]["B"] for r in trace.ranks]
        w_r = [0.0] * p
    est = schedule_estimate(schedule, f_r, b_r, w_r, m)
    formula = {r: 1.0 - m * (f_r[i] + b_r[i] + w_r[i]) / est.step_s for i, r in enumerate(trace.ranks)}
    fc = statistics.median(per[r]["F"] for r in trace.ranks)
    if schedule == "zb":
        ic = statistics.median(per[r]["I"] for r in trace.ranks)
        wc = statistics.median(per[r]["W"] for r in trace.ranks)
    else:
        ic = wc = statistics.median(per[r]["B"] for r in trace.ranks) / 2
    tl = simulate_timeline(pipeline_order(schedule, p, m, v), p, p * v, fc, ic, wc)
    sim = {r: 1.0 - tl.busy_s[r] / tl.step_s for r in trace.ranks}
    ideal = schedule_estimate(schedule, [1.0] * p, [1.0] * p if schedule == "zb" else [2.0] * p,
                              [1.0 if schedule == "zb" else 0.0] * p, m)
    wall = statistics.median(s.duration_s for s in trace.steps if s.rank == 0)
    # time blocked on point-to-point messages: the executor's wait spans (a send or receive waited for), and, for
    # traces of the executor before posted sends/receives, its send/recv spans (each a blocking wait)
    comm = {r: sum(s.duration_s for s in trace.spans if s.rank == r and (
        (s.kind == "wait" and s.args.get("on") in ("send", "recv"))
        or (s.kind in ("send", "recv") and not s.args.get("posted")))) / len(steps) for r in trace.ranks}
    idle_ms = {r: 1e3 * measured[r] * statistics.mean(s.duration_s for s in trace.steps if s.rank == r)
               for r in trace.ranks}
    return {"measured": measured, "sched": sched, "formula": formula, "formula_bubble_fraction": est.bubble_fraction,
            "sim": sim, "sim_bubble_fraction": tl.bubble_fraction, "ideal": ideal.bubble_fraction,
            "times_ms": {r: {k: 1e3 * x for k, x in d.items()} for r, d in per.items()},
            "step_ms": 1e3 * wall, "predicted_step_ms_from_measured_times": 1e3 * est.step_s,
            "p2p_wait_ms_per_step": {r: 1e3 * c for r, c in comm.items()}, "idle_ms_per_step": idle_ms}


# --------------------------------------------------------------------------- driver

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256, help="global batch rows")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per block")
    ap.add_argument("--reps", type=int, default=2, help="blocks of each configuration (alternating order)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--p2p", default="posted", help="comma-separated point-to-point semantics to run side by side: "
                    "posted (the executor's isend/irecv, waited at use and at the step's end) and/or blocking (each "
                    "send and receive waited for at its place in the list, as before)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--save-traces", metavar="DIR", help="write each configuration's per-rank trace records (JSON, "
                    "the format of TraceRecorder.save) under DIR/<schedule>_m<M>/rank<R>.json")
    args = ap.parse_args()

    from safetensors.torch import save_file

    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.pipeline_schedules import stages_per_rank
    from adaptdist.runtime.launch import launch_local
    from adaptdist.stage_program_io import save_pipeline_programs
    from adaptdist.runtime.trace import merge_traces

    load_before = os.getloadavg()
    p = args.nproc
    mbs = [int(x) for x in args.microbatches.split(",")]
    scheds = args.schedules.split(",")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-pp-bubble-") as tmp:
        tmp = Path(tmp)
        model, batch, loss_fn = build(args.rows, args.width, args.layers)
        dirs, meta, modes = {}, {}, {}
        p2p = args.p2p.split(",")
        if not p2p or set(p2p) - {"posted", "blocking"}:
            ap.error(f"--p2p takes posted and/or blocking, got {args.p2p!r}")
        for m in mbs:
            for s in scheds:
                v = stages_per_rank(s)
                base = f"{s} m={m}"
                programs = compile_model(model, batch, loss_fn, p, None, LoweringOptions(),
                                         pipeline=PipelineOptions(stages=p * v, microbatches=m, schedule=s,
                                                                  stages_per_rank=v))
                d = str(save_pipeline_programs(programs, tmp / base.replace(" ", "_").replace("=", "")))
                for mode in p2p:
                    name = base if mode == "posted" else f"{base} {mode}"
                    dirs[name], meta[name], modes[name] = d, (s, m, v), mode
        compile_s = time.perf_counter() - t_start
        save_file({"b0": batch[0].contiguous(), "b1": batch[1].contiguous()}, str(tmp / "batch.safetensors"))
        cfg = dict(dirs=dirs, batch_file=str(tmp / "batch.safetensors"), warmup=args.warmup, steps=args.steps,
                   reps=args.reps, threads=args.threads, timeout_s=args.timeout_s, microbatches=mbs,
                   rows=args.rows, width=args.width, p2p=modes)
        t0 = time.perf_counter()
        res = launch_local(worker, (cfg,), p)
        run_s = time.perf_counter() - t0
    load_after = os.getloadavg()
    out = {"model": f"WideMLP: {args.layers} x Linear({args.width}, {args.width}) + ReLU, {args.rows} rows, MSE, SGD",
           "nproc": p, "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
           "compile_s": compile_s, "run_s": run_s, "configs": {}}
    measured_steps = list(range(args.warmup, args.warmup + args.steps * args.reps))
    print(f"{out['model']}; {p} gloo ranks, {args.threads} thread(s) each; {len(measured_steps)} measured steps per "
          f"configuration (first {args.warmup} dropped)")
    hdr = (f"{'schedule':18} {'m':>2} {'rank':>4} {'measured':>8} {'sched':>6} {'formula':>7} {'sim':>6} {'ideal':>6}"
           f"  {'F ms':>6} {'B ms':>6} {'I ms':>6} {'W ms':>6} {'p2p wait ms':>11} {'idle ms':>7} {'step ms':>8}"
           f"  p2p")
    print(hdr)
    for name, (s, m, v) in meta.items():
        trace = merge_traces([res[r]["traces"][name] for r in range(p)]).window(measured_steps)
        a = analyse(trace, s, p, m, v)
        out["configs"][name] = {**a, "p2p": modes[name]}
        for r in trace.ranks:
            t = a["times_ms"][r]
            print(f"{s:18} {m:2d} {r:4d} {a['measured'][r]:8.3f} {a['sched'][r]:6.3f} {a['formula'][r]:7.3f} "
                  f"{a['sim'][r]:6.3f} {a['ideal']:6.3f}  {t['F']:6.1f} {t['B']:6.1f} {t['I']:6.1f} {t['W']:6.1f} "
                  f"{a['p2p_wait_ms_per_step'][r]:11.1f} {a['idle_ms_per_step'][r]:7.1f} {a['step_ms']:8.1f}  "
                  f"{modes[name]}")
    out["one_way_message_ms"] = {m: 1e3 * x for m, x in res[0]["one_way_s"].items()}
    print("one activation message alone (rows/m x width float32, rank 0 -> 1, blocking): "
          + ", ".join(f"m={m}: {1e3 * x:.2f} ms" for m, x in res[0]["one_way_s"].items()))
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores; compile "
          f"{compile_s:.0f} s, run {run_s:.0f} s")
    if args.save_traces:
        for name in meta:
            d = Path(args.save_traces) / name.replace(" ", "_").replace("=", "")
            d.mkdir(parents=True, exist_ok=True)
            for r in range(p):
                (d / f"rank{r}.json").write_text(json.dumps(res[r]["traces"][name]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    raise SystemExit(main())
