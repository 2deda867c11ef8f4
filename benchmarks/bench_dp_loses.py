"""Where data parallelism loses on this machine: the planner's plan vs hand-written dp, fsdp, tp and pp, measured.

A few very wide Linear layers (``WideMLP``: ``--layers`` x Linear(width, width) + ReLU, default 4 x 2048: 16.8 M
parameters, 64 MiB of float32 gradients) on a small batch (``--rows 128``), MSE loss, SGD, on ``--nproc 2`` gloo
ranks: under dp every step all-reduces 64 MiB of gradients, while the activations a pipeline stage sends are
``rows x width`` floats (1 MiB) and tensor parallelism all-reduces ``rows x width`` activations per layer pair.

The cluster is measured first (``profile_local``, what ``adaptdist cluster profile`` runs; ``--cluster FILE``
takes a saved one instead). Plans, each lowered to programs in this process:

- ``dp``, ``fsdp``, ``tp`` (Megatron column/row: ``layers.{even}`` S(0), ``layers.{odd}.weight`` S(1)): the presets of
  ``--plan dp|fsdp|tp``;
- ``pp``: ``--plan pp`` (one stage per rank, 1F1B, one microbatch per stage) and ``pp m=2N`` (``--microbatches 2N``);
- on 4 ranks also the mixes: ``dp,tp`` (``--mesh dp=2,tp=2``), ``pp=2,dp=2`` and ``pp=2,tp=2`` (``--mesh pp=2,...``);
- ``auto``: ``--plan auto`` (``run_planner``: the SPMD planner, pipelines not weighed by default);
- ``auto+pp``: ``run_planner(..., pipeline=True)``: the SPMD plan or the inter-stage planner's pipeline, whichever
  is predicted faster (what the planner's plan is when stages are weighed);
- ``planner-pp``: the inter-stage planner's pipeline itself (``plan_pipeline(uniform=True)``: its stages,
  schedule and microbatches), lowered whether or not it is chosen;
- ``--plan-file NAME=FILE`` (repeatable): a saved plan JSON of this model (``Plan.to_json``, e.g. another
  version's planner's), side by side with the rest; not counted as hand-written.

Every plan's programs run in ONE process group, blocks of ``--steps`` steps alternating (A B C ..., then
reversed), after ``--warmup`` steps each; per step, rank 0's wall time between two barriers. ``--plans`` runs a
subset (dp and the ``--plan-file`` plans always). Printed: each plan's median step, its ratio to the best
hand-written plan and to dp, the same ratio paired (the median over the ``--reps`` rounds of each round's ratio of
block medians: on a loaded machine, blocks next to each other in time share the load), and its predicted step
(SPMD: ``estimate_programs`` on the measured cluster; pipelines: the inter-stage planner's ``step_s`` for that
stage count, schedule and microbatches). Also measured alone: the 64 MiB gradient all_reduce, and one ``rows x
width`` activation send.

Outside CI::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dp_loses.py [--width 2048] [--layers 4] [--rows 128]
        [--steps 4] [--reps 2] [--warmup 1] [--cluster FILE] [--plans dp,tp,auto] [--plan-file NAME=FILE]
        [--json FILE]
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
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


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


def tp_plan(layers: int) -> dict[str, str]:
    """Megatron pairs: column-parallel even layers (weight and bias S(0)), row-parallel odd ones (weight S(1))."""
    out = {}
    for i in range(layers):
        if i % 2 == 0 and i + 1 < layers:
            out[f"layers.{i}.weight"] = "S(0)"
            out[f"layers.{i}.bias"] = "S(0)"
        elif i % 2 == 1:
            out[f"layers.{i}.weight"] = "S(1)"
    return out


def paired_ratio(times: dict[str, list[float]], name: str, ref: str, steps: int, reps: int) -> float:
    """Median over the rounds of (``name``'s block median / ``ref``'s block median) in that round."""
    def block(k: str, r: int) -> float:
        return statistics.median(times[k][r * steps:(r + 1) * steps])
    return statistics.median(block(name, r) / block(ref, r) for r in range(reps))


# --------------------------------------------------------------------------- worker (one per rank)

def worker(cfg: dict) -> dict:
    from safetensors.torch import load_file

    from adaptdist import _torch_compat as compat
    from adaptdist.program import load_program
    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.stage_program_io import load_pipeline_program
    from adaptdist.runtime.worker import StepRunner, make_optimizer, register_mesh_groups

    torch.set_num_threads(cfg["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        t = load_file(cfg["batch_file"])
        batch = (t["b0"], t["b1"])
        runners, regs = {}, {}
        for name, (kind, d) in cfg["dirs"].items():
            if kind == "pipeline":
                program = load_pipeline_program(d, rank, world_size=world)
                groups = setup_pipeline_groups(program, cfg["timeout_s"])
                runners[name] = PipelineStepRunner(program, "sgd", 1e-3, groups, timeout_s=cfg["timeout_s"],
                                                   make_optimizer=make_optimizer)
                regs[name] = [(n, groups[tuple(sorted(r))]) for n, r in program.groups.items()]
            else:
                program = load_program(d, rank, world_size=world)
                mesh = register_mesh_groups(program, "gloo")
                names = tuple(program.mesh)
                regs[name] = [(n, mesh.get_group(a) if len(names) > 1 else dist.group.WORLD)
                              for a, n in program.group_names.items()]
                runners[name] = StepRunner(program, "sgd", 1e-3)

        def use(name):  # the group names every plan's collectives resolve: re-pointed to this plan's groups
            for n, g in regs[name]:
                compat.register_process_group(n, g)

        def timed(name: str) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            runners[name].step(batch)
            dist.barrier()
            return time.perf_counter() - t0

        names = list(cfg["dirs"])
        times: dict[str, list[float]] = {n: [] for n in names}
        for name in names:
            use(name)
            for _ in range(cfg["warmup"]):
                timed(name)
        for rep in range(cfg["reps"]):
            for name in (names if rep % 2 == 0 else names[::-1]):
                use(name)
                times[name] += [timed(name) for _ in range(cfg["steps"])]
        # the collectives alone: every gradient in one all_reduce (what dp does per step), one activation send
        grad = torch.zeros(cfg["num_params"])
        ar = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(grad)
            ar.append(time.perf_counter() - t0)
        act = torch.zeros(cfg["rows"], cfg["width"])
        pp = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(act, 1)
                dist.recv(act, 1)
            elif rank == 1:
                dist.recv(act, 0)
                dist.send(act, 0)
            pp.append((time.perf_counter() - t0) / 2)
        return {"times": times, "all_reduce_s": statistics.median(ar), "send_s": statistics.median(pp)}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- driver

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per block")
    ap.add_argument("--reps", type=int, default=2, help="blocks of each plan (alternating order)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--cluster", default=None, help="a cluster file (adaptdist cluster profile), or 'estimated' (uncalibrated); "
                    "default: measure now")
    ap.add_argument("--save-cluster", metavar="FILE", help="write the measured cluster here (for --cluster FILE)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--plans", default=None, help="comma-separated plan names to run (dp always), default all")
    ap.add_argument("--plan-file", action="append", default=[], metavar="NAME=FILE",
                    help="also run this saved plan JSON under NAME (repeatable)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    from safetensors.torch import save_file

    from adaptdist.annotations import ManualPlan
    from adaptdist.calibrate.local import load_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from adaptdist.compiler.planner.stages import pipeline_plan, plan_pipeline
    from adaptdist.compiler.planner.summary import run_planner
    from adaptdist.cost_models.estimate import estimate_programs
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.mesh import Mesh
    from adaptdist.plan import Plan
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local
    from adaptdist.stage_program_io import save_pipeline_programs
    from adaptdist.stage_program import PipelineRankProgram

    load_before = os.getloadavg()
    n = args.nproc
    t_start = time.perf_counter()
    if args.cluster == "estimated":  # uncalibrated figures (local_cluster): for a quick plumbing check
        from adaptdist.calibrate.local import local_cluster

        cluster = local_cluster(n)
    elif args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        from adaptdist.calibrate.profile import profile_local

        cluster = profile_local(n, "cpu", compute_dtypes=("float32",)).cluster
        if args.save_cluster:
            from adaptdist.cluster_file import save_cluster

            save_cluster(cluster, args.save_cluster)
    profile_s = time.perf_counter() - t_start
    model, batch, loss_fn = build(args.rows, args.width, args.layers)
    module = SimpleNamespace(TP_PLAN=tp_plan(args.layers))
    cg = capture(model, batch, loss_fn)
    t0 = time.perf_counter()
    auto = run_planner(cg, cluster, None, "sgd")
    auto_pp = run_planner(cg, cluster, None, "sgd", pipeline=True)
    choice = auto_pp.pipeline if not isinstance(auto_pp.pipeline, str) else plan_pipeline(
        cg, cluster, optimizer="sgd", spmd_step_s=auto.predicted.step_s, pg=auto.graph, uniform=True)
    planner_s = time.perf_counter() - t0
    opts = LoweringOptions()
    plans: dict[str, tuple] = {  # name -> (plan or None, PipelineOptions or None, planner's predicted step or None)
        "dp": (ManualPlan.parse("dp"), None, None),
        "fsdp": (ManualPlan.parse("fsdp"), None, None),
        "tp": (ManualPlan.parse("tp", module), None, None),
        "pp": (None, PipelineOptions(stages=n, microbatches=n, schedule="1f1b"), None),
        f"pp m={2 * n}": (None, PipelineOptions(stages=n, microbatches=2 * n, schedule="1f1b"), None),
        "auto": (auto.plan, None, auto.predicted.step_s),
        "auto+pp": (auto_pp.plan, None, auto_pp.predicted.step_s if auto_pp.plan.pipeline is None else choice.step_s),
    }
    not_lowered = {}
    saved = {}
    for spec in args.plan_file:
        name, sep, file = spec.partition("=")
        if not sep or not name or name in plans:
            raise SystemExit(f"--plan-file {spec!r}: give NAME=FILE with a NAME not among {list(plans)}")
        saved[name] = (Plan.load(file), None, None)
    plans.update(saved)
    try:
        plans["planner-pp"] = (pipeline_plan(cg, choice, n), None, choice.step_s)
    except Exception as e:  # noqa: BLE001 -- a benchmark row says why it has no pipeline
        not_lowered["planner-pp"] = f"{type(e).__name__}: {e}"
    meshes: dict[str, str] = {}
    if n == 4:  # the mixes a 2 x 2 mesh allows
        plans["dp,tp"] = (ManualPlan.parse("dp,tp", module), None, None)
        plans["pp=2,dp=2"] = (None, PipelineOptions(stages=None, microbatches=4, schedule="1f1b"), None)
        plans["pp=2,tp=2"] = (ManualPlan.parse("tp", module), PipelineOptions(stages=None, microbatches=2,
                                                                              schedule="1f1b"), None)
        meshes = {"dp,tp": "dp=2,tp=2", "pp=2,dp=2": "pp=2,dp=2", "pp=2,tp=2": "pp=2,tp=2"}
    if args.plans:
        keep = {"dp", *saved} | {k.strip() for k in args.plans.split(",")}
        unknown = keep - set(plans) - set(not_lowered)
        if unknown:
            raise SystemExit(f"--plans: no plan named {sorted(unknown)}; the plans: {list(plans)}")
        plans = {k: v for k, v in plans.items() if k in keep}
        not_lowered = {k: v for k, v in not_lowered.items() if k in keep}
    hand_written = [k for k in plans if k not in ("auto", "auto+pp", "planner-pp") and k not in saved]
    for k, why in not_lowered.items():
        print(f"{k}: not lowered ({why[:300]})")
    described = {"auto": f"{auto.candidate}", "auto+pp": "pipeline" if auto_pp.plan.pipeline is not None
                 else f"{auto_pp.candidate} (pipeline not chosen)",
                 "planner-pp": f"{choice.num_stages} stages {[len(s.layers) for s in choice.stages]} "
                               f"{choice.schedule} m={choice.microbatches}"}
    predicted: dict[str, float] = {}
    codes: dict[str, list[str]] = {}  # SPMD plan -> each rank's program text without comments (to spot twins)
    with tempfile.TemporaryDirectory(prefix="bench-dp-loses-") as tmp:
        tmp = Path(tmp)
        dirs = {}
        for name, (plan, popts, pred) in plans.items():
            programs = compile_model(model, batch, loss_fn, n, plan, opts, pipeline=popts, mesh=meshes.get(name),
                                     captured=None if popts is not None else cg)
            d = tmp / name.replace(" ", "_").replace("=", "").replace("+", "_")
            if isinstance(next(iter(programs.values())), PipelineRankProgram):
                dirs[name] = ("pipeline", str(save_pipeline_programs(programs, d)))
                p0 = programs[0]
                if pred is None:  # the inter-stage planner's prediction of this very pipeline
                    sub = {a: k for a, k in p0.plan.mesh.items() if a != "pp"} if p0.plan is not None else {}
                    pred = plan_pipeline(cg, cluster, optimizer="sgd", pg=auto.graph, uniform=True,
                                         num_stages=p0.stages[0].num_stages, microbatches=[p0.num_microbatches],
                                         schedules=[p0.schedule],
                                         submesh=Mesh.parse(",".join(f"{a}={k}" for a, k in sub.items()))
                                         if sub else None).step_s
                described.setdefault(name, f"{p0.stages[0].num_stages} stages {p0.schedule} m={p0.num_microbatches}")
            else:
                dirs[name] = ("spmd", str(save_programs(programs, d)))
                codes[name] = ["\n".join(x for x in programs[r].code.splitlines() if not x.lstrip().startswith("#"))
                               for r in sorted(programs)]
                pred = estimate_programs(programs, cluster, "sgd").step_s
                described.setdefault(name, ",".join(f"{a}={k}" for a, k in programs[0].mesh.items()))
            predicted[name] = pred
        compile_s = time.perf_counter() - t_start - profile_s
        save_file({"b0": batch[0].contiguous(), "b1": batch[1].contiguous()}, str(tmp / "batch.safetensors"))
        cfg = dict(dirs=dirs, batch_file=str(tmp / "batch.safetensors"), warmup=args.warmup, steps=args.steps,
                   reps=args.reps, threads=args.threads, timeout_s=args.timeout_s, rows=args.rows, width=args.width,
                   num_params=sum(p.numel() for p in model.parameters()))
        t1 = time.perf_counter()
        res = launch_local(worker, (cfg,), n)
        run_s = time.perf_counter() - t1
    load_after = os.getloadavg()
    r0 = res[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    best_hand = min(hand_written, key=lambda k: med[k])
    paired = {k: paired_ratio(r0["times"], k, best_hand, args.steps, args.reps) for k in med}
    twins = {k: [h for h in hand_written if h in codes and codes[h] == codes[k]]
             for k in ("auto", "auto+pp", "planner-pp", *saved) if k in codes}
    out = {"model": f"WideMLP: {args.layers} x Linear({args.width}, {args.width}) + ReLU, {cfg['num_params']:,} "
                    f"parameters, {args.rows} rows, MSE, SGD",
           "nproc": n, "cluster": repr(cluster), "described": described,
           "measured_step_ms": {k: 1e3 * v for k, v in med.items()},
           "measured_quartiles_ms": {k: [1e3 * q for q in statistics.quantiles(v, n=4)] for k, v in r0["times"].items()},
           "predicted_step_ms": {k: 1e3 * v for k, v in predicted.items()},
           "best_hand_written": best_hand, "not_lowered": not_lowered, "paired_ratio_to_best_hand": paired,
           "same_programs_as": twins,
           "planner_own_predicted_ms": {"auto": 1e3 * auto.predicted.step_s, "auto+pp": 1e3 * auto_pp.predicted.step_s},
           "grad_all_reduce_ms": 1e3 * r0["all_reduce_s"], "activation_send_ms": 1e3 * r0["send_s"],
           "planner_schedules": {e.schedule: 1e3 * e.step_s for e in choice.schedules if e.microbatches == choice.microbatches},
           "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
           "profile_s": profile_s, "planner_s": planner_s, "compile_s": compile_s, "run_s": run_s}
    print(f"{out['model']}; {n} gloo ranks, {args.threads} thread(s) each; {cluster!r}")
    print(f"{'plan':11} {'what':34} {'measured ms':>11} {'q1-q3':>13} {'/best hand':>10} {'paired':>7} {'/dp':>6} "
          f"{'predicted ms':>12}")
    for k in plans:
        q = out["measured_quartiles_ms"][k]
        print(f"{k:11} {described[k][:34]:34} {1e3 * med[k]:11.1f} {q[0]:6.0f}-{q[2]:<6.0f} {med[k] / med[best_hand]:10.3f} "
              f"{paired[k]:7.3f} {med[k] / med['dp']:6.3f} {1e3 * predicted[k]:12.1f}")
    print(f"best hand-written: {best_hand}; the {4 * cfg['num_params'] / 2**20:.0f} MiB gradient all_reduce alone {out['grad_all_reduce_ms']:.1f} ms, "
          f"one {args.rows}x{args.width} activation send {out['activation_send_ms']:.2f} ms")
    print("the planner's own predicted step (PlannerResult.predicted): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in out["planner_own_predicted_ms"].items()))
    for k, same in twins.items():
        if same:
            print(f"{k}'s rank programs are the same code as {', '.join(same)}'s")
    for k in [k for k in ("auto", "auto+pp", "planner-pp") if k in med]:
        print(f"target {k}: {med[k] / med[best_hand]:.3f}x the best hand-written ({'met' if med[k] <= 1.05 * med[best_hand] else 'MISSED'}"
              f", <= 1.05; paired {paired[k]:.3f}x), {med[k] / med['dp']:.3f}x dp "
              f"({'faster' if med[k] < med['dp'] else 'NOT faster'})")
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores; profile {profile_s:.0f} s, "
          f"planner {planner_s:.0f} s, compile {compile_s:.0f} s, run {run_s:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    raise SystemExit(main())
