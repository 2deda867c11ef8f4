"""adaptdist's global planner (``adaptdist.compiler.planner.plan_auto``): how long it takes, and how good its plans are.

**Part 1, planner time** (no devices needed: models built on meta tensors, captured with fake values). For
GPT- and LLaMA-style graphs of ``--layers`` layers on ``--devices`` devices it prints, per case, the time of
each phase from capture to plan -- capture, ``graph`` (planning graph: layer classes, liveness, costs),
``solve`` (every mesh shape's per-axis ILPs, strategy lists and problem building included), ``plan``
(writing the Plan) -- the mesh chosen, the predicted step time, the ILP status and worst gap of the chosen
shape's axes, the number of ILP variables, and beside it, in the same run, the random-walk baseline
(``plan_auto(searcher="random_walk")``, the greedy walk of Ao et al. 2021, point 5 of the planner issue):
its search time and the predicted step time of its plan, as a ratio to the ILP's.

- Clusters: hosts of 8 GPUs, 80 GB each, 450 GB/s and 5 us between GPUs of a host, 50 GB/s and 10 us between
  hosts; peak FLOP/s and memory bandwidth of an A100-80GB datasheet (the figures ``FixedCluster.uniform``
  gives CUDA devices: 312 TFLOP/s bf16, 19.5 fp32, 2.0 TB/s). Each is written as a cluster file (schema 2,
  ``adaptdist/cluster.py``; one device entry per GPU, ``links`` with the two tier defaults) and loaded with
  ``load_cluster``, as ``adaptdist plan --cluster FILE`` would; the load time is printed apart.
- LLaMA-style: ``adaptdist.models.llama`` with LLaMA-3-8B shapes (dim 4096, 32 heads, 8 KV heads, FFN 14336,
  vocabulary 128256, sequence 8192, RoPE theta 5e5), bf16 parameters, ``--layers`` layers.
- GPT-style: ``adaptdist.models.gpt`` with GPT-3-XL shapes (Brown et al. 2020, table 2.1: dim 2048, 16 heads,
  sequence 2048; GPT-2's BPE vocabulary of 50257 -- GPTConfig takes any vocabulary size; learned position
  embedding, LayerNorm, GELU MLP of 4x dim, biases, tied output head), bf16 parameters.
- Global batch: 16 sequences (the headline's) on 8 and 64 devices; 512 on 1024 devices (LLaMA-3's 4M-token
  batch), since 16 sequences can be split at most 16 ways and would leave 1024 ranks only mesh shapes with
  >= 64-way model parallelism across hosts (dozens of shapes to try). ``--batch`` changes this.
- AdamW optimizer state; ``plan_auto``'s defaults otherwise (30 s limit per ILP).
- Each (model, layers, batch) is captured once and reused for every device count; the capture time is
  printed with every case it serves and counted in each total.

The **headline** (printed first, with PASS/FAIL): LLaMA-3-8B shapes, 32 layers, global batch 16, 64 devices
(8 hosts), captured fresh in this process (so its capture pays the tracer's one-time start-up, as a command
line would): first with the mesh fixed at ``dp=8,tp=8``, then with the mesh searched. Targets with the
mesh fixed: <= 20 s in total (model built on meta + capture + planning), <= 10 s after capture, every axis's
ILP proven optimal or with a gap <= 1%. ``--profile`` also runs both (fixed and searched, ILP) once more under
cProfile and prints where the planning time goes (not timed).

**Part 2, plan quality** (2 and 4 local ranks, gloo on CPU; the machinery of ``bench_cost_model.py``): the
built-in GPT of ``bench_cost_model`` (GPTConfig with 4 heads, global batch 8 x 64); its hand-written plans
(``bench_cost_model.default_plans``: DP with 25 MiB and with 1 MiB gradient buckets, FSDP-like, TP, and
DP x TP on a 2x2 mesh on 4 ranks) and the planner's plan, planned for the cluster ``adaptdist cluster
profile`` calibrates right before (``plan_auto(capture(...), cluster)``, lowered by ``compile_model(...,
plan, captured=...)``), all measured in one launch per world size in alternating rounds. Per world size:
each plan's median step (slowest rank per step, median over every measured step) and the spread of its
per-round medians; the ratio of the auto plan to the best hand-written plan, with the same ratio per round
(both measured in the same round) as its spread. Target: <= 1.05. Beside the measurements: each plan's
step time by the cost model (``estimate_programs`` on the lowered rank programs, same cluster), and for the
auto plan the planner's own prediction, to tell a wrong choice from a choice lowered differently.

The machine is shared: before the headline and before each world size of part 2 the benchmark waits (up to
``--wait-s``) for quiet (``bench_cost_model.wait_for_quiet``), samples the load in every phase and marks a
case DISTURBED when other people's runnable tasks averaged more than ``--max-outside`` during it.

    .venv/bin/python benchmarks/bench_planner.py [--part time|quality|all] [--headline-only] [--quick]
        [--models gpt,llama] [--layers 2,8,32,96] [--devices 8,64,1024] [--batch 16,1024:512] [--profile]
        [--worlds 2,4] [--rounds 4] [--steps 8] [--max-load 1.5] [--wait-s 240] [--json FILE]

``--quick``: layers 2,8 on 8 and 64 devices, 2 rounds of 4 steps in part 2. The workers of part 2 live in
``bench_cost_model`` (imported from this directory, which is also put on ``PYTHONPATH`` for the spawned ranks).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

GIB = 2**30
MIB = 2**20

# Devices: an A100-80GB datasheet's peaks (adaptdist.cost_models.hardware's CUDA defaults), 80 GB of memory.
GPU = {"kind": "cuda", "peak_flops": {"float32": 19.5e12, "float64": 9.7e12, "bfloat16": 312e12, "float16": 312e12},
       "memory_bytes": 80 * 10**9, "memory_bandwidth_bytes_per_s": 2.0e12}
GPUS_PER_HOST = 8
INTRA_HOST = {"tier": "intra_host", "bandwidth_bytes_per_s": 450e9, "latency_s": 5e-6}
INTER_HOST = {"tier": "inter_host", "bandwidth_bytes_per_s": 50e9, "latency_s": 1e-5}

HEADLINE = {"model": "llama", "layers": 32, "devices": 64, "batch": 16, "mesh": "dp=8,tp=8"}
TARGET_TOTAL_S = 20.0
TARGET_AFTER_CAPTURE_S = 10.0
TARGET_GAP = 0.01
TARGET_QUALITY = 1.05
PROFILED = ("graph.py:build_planning_graph", "problem.py:strategies_on_axis", "problem.py:build_axis_problem",
            "ilp.py:solve", "random_walk.py:random_walk", "search.py:evaluate", "search.py:_to_plan")


# --------------------------------------------------------------------------- clusters and models

def write_cluster_file(path: Path, devices: int) -> Path:
    """A schema-2 cluster file of ``devices // 8`` hosts of 8 GPUs (module docstring); returns ``path``."""
    import yaml

    if devices % GPUS_PER_HOST:
        raise SystemExit(f"--devices: {devices} is not a multiple of {GPUS_PER_HOST} GPUs per host")
    hosts = [{"name": f"h{h}", "devices": [dict(rank=h * GPUS_PER_HOST + i, **GPU) for i in range(GPUS_PER_HOST)]}
             for h in range(devices // GPUS_PER_HOST)]
    links = [INTRA_HOST] + ([INTER_HOST] if devices > GPUS_PER_HOST else [])
    doc = {"schema_version": 2, "hosts": hosts, "links": links, "calibration": None}
    path.write_text(f"# {devices} GPUs in hosts of {GPUS_PER_HOST} (benchmarks/bench_planner.py)\n"
                    + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=160))
    return path


def model_config(model: str, layers: int):
    """``(config, sequence length, description)`` of the ``model`` family (module docstring) with ``layers`` layers."""
    if model == "llama":
        from adaptdist.models.llama import LlamaConfig

        return (LlamaConfig(vocab_size=128256, max_seq_len=8192, dim=4096, num_layers=layers, num_heads=32,
                            num_kv_heads=8, ffn_dim=14336, rope_theta=500000.0), 8192,
                "LLaMA-3-8B shapes (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256, seq 8192)")
    if model == "gpt":
        from adaptdist.models.gpt import GPTConfig

        return (GPTConfig(vocab_size=50257, max_seq_len=2048, dim=2048, num_layers=layers, num_heads=16, mlp_ratio=4),
                2048, "GPT-3-XL shapes (dim 2048, 16 heads, MLP 8192, vocab 50257, seq 2048)")
    raise SystemExit(f"--models: unknown model {model!r}; use gpt and/or llama")


def build_on_meta(model: str, layers: int, batch: int):
    """``(module, (tokens, targets), loss_fn)``: the model on meta tensors in bf16, a meta batch ``int64[batch, seq]``."""
    from adaptdist.models import gpt, llama

    cfg, seq, _ = model_config(model, layers)
    with torch.device("meta"):
        m = (llama.Llama(cfg) if model == "llama" else gpt.GPT(cfg)).to(torch.bfloat16)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    targets = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return m, (tokens, targets), (llama.lm_loss if model == "llama" else gpt.lm_loss)


@dataclass
class Captured:
    graph: object
    build_s: float
    capture_s: float
    nodes: int
    params: int


def capture_on_meta(model: str, layers: int, batch: int) -> Captured:
    """Build ``model`` on meta tensors and capture its training step, each timed."""
    from adaptdist.compiler.capture import capture

    t0 = time.perf_counter()
    m, b, loss_fn = build_on_meta(model, layers, batch)
    t1 = time.perf_counter()
    cap = capture(m, b, loss_fn)
    t2 = time.perf_counter()
    return Captured(cap, t1 - t0, t2 - t1, len(cap.gm.graph.nodes), sum(p.numel() for p in m.parameters()))


# --------------------------------------------------------------------------- one planner run

@dataclass
class Run:
    """One ``plan_auto`` call: phases (s), the chosen mesh and its prediction, or why it failed."""

    searcher: str
    phases_s: dict = field(default_factory=dict)
    wall_s: float = 0.0
    mesh: str = ""
    step_s: float = float("nan")
    memory_bytes: float = float("nan")
    statuses: dict = field(default_factory=dict)  # axis -> (status, gap, variables, constraints, solve_s)
    shapes_tried: int = 0
    error: str = ""
    reason: str = ""

    @property
    def after_capture_s(self) -> float:
        return sum(self.phases_s.values()) if self.phases_s else self.wall_s

    @property
    def worst_gap(self) -> float:
        return max((s[1] for s in self.statuses.values()), default=float("nan"))

    @property
    def variables(self) -> int:
        return max((s[2] for s in self.statuses.values()), default=0)

    def status_text(self) -> str:
        if self.error:
            return self.error
        st = sorted({s[0] for s in self.statuses.values()})
        return "/".join(st) + (f", gap {100 * self.worst_gap:.2g}%" if self.searcher == "ilp" else "")

    def to_dict(self) -> dict:
        return {"searcher": self.searcher, "phases_s": self.phases_s, "wall_s": self.wall_s,
                "after_capture_s": self.after_capture_s, "mesh": self.mesh, "step_s": self.step_s,
                "memory_bytes": self.memory_bytes, "statuses": self.statuses, "shapes_tried": self.shapes_tried,
                "error": self.error, "reason": self.reason}


def run_planner(cap, cluster, searcher: str, mesh: str | None = None) -> Run:
    """``plan_auto`` on a captured step (``mesh``: fixed, else searched); an infeasible plan is a result too."""
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.errors import PlanInfeasibleError
    from adaptdist.mesh import Mesh

    out = Run(searcher)
    t0 = time.perf_counter()
    try:
        r = plan_auto(cap, cluster, mesh=Mesh.parse(mesh) if mesh else None, optimizer="adamw", searcher=searcher)
    except PlanInfeasibleError as e:
        out.wall_s = time.perf_counter() - t0
        out.error = "infeasible"
        out.reason = str(e).split("\n")[0]
        return out
    out.wall_s = time.perf_counter() - t0
    out.phases_s = dict(r.phases_s)
    out.mesh = ",".join(f"{a}={n}" for a, n in r.plan.mesh.items())
    out.step_s = r.predicted.step_s
    out.memory_bytes = r.predicted.memory_bytes
    out.statuses = {a: (s.result.status, s.result.gap, s.result.num_variables, s.result.num_constraints,
                        s.result.solve_s) for a, s in r.axes.items()}
    out.shapes_tried = len(r.tried)
    return out


def profile_planner(con, cap, cluster, mesh: str | None) -> dict[str, float]:
    """Run ``plan_auto`` once under cProfile; print and return the cumulative seconds of the planner's stages
    (:data:`PROFILED`), of HiGHS's ``Solve`` and the total (profiled, so slower than the timed runs)."""
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.mesh import Mesh

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    plan_auto(cap, cluster, mesh=Mesh.parse(mesh) if mesh else None, optimizer="adamw")
    prof.disable()
    total = time.perf_counter() - t0
    st = pstats.Stats(prof)
    cum: dict[str, float] = {}
    calls: dict[str, int] = {}
    for (file, _line, fn), (_cc, nc, _tt, ct, _callers) in st.stats.items():
        key = f"{Path(file).name}:{fn}"
        if key in PROFILED:
            cum[key] = cum.get(key, 0.0) + ct
            calls[key] = calls.get(key, 0) + nc
        elif "Solver_Solve" in fn:  # the C++ call (pywraplp's Python Solve wraps it: counted once)
            cum["HiGHS Solve (in ilp.solve)"] = cum.get("HiGHS Solve (in ilp.solve)", 0.0) + ct
            calls["HiGHS Solve (in ilp.solve)"] = calls.get("HiGHS Solve (in ilp.solve)", 0) + nc
    con.print(f"  profile of plan_auto (mesh {'fixed ' + mesh if mesh else 'searched'}, under cProfile: {total:.1f} s "
              "in all): cumulative seconds (calls): "
              + "; ".join(f"{k} {v:.2f} ({calls[k]})" for k, v in sorted(cum.items(), key=lambda kv: -kv[1])))
    selfs = sorted(((tt, f"{Path(f).name}:{fn}") for (f, _l, fn), (_c, _n, tt, _ct, _cl) in st.stats.items()),
                   reverse=True)
    con.print("  largest self times (s): " + "; ".join(f"{name} {tt:.2f}" for tt, name in selfs[:10]))
    cum["total_profiled_s"] = total
    return cum


# --------------------------------------------------------------------------- part 1

def _s(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def _ms(x: float) -> str:
    return "-" if x != x else f"{1e3 * x:.1f}"


def batch_for(spec: str, devices: int) -> int:
    """``--batch 16,1024:512``: 16 sequences unless ``devices:batch`` says otherwise."""
    default, per = None, {}
    for part in spec.split(","):
        if ":" in part:
            d, b = part.split(":")
            per[int(d)] = int(b)
        elif part:
            default = int(part)
    if devices in per:
        return per[devices]
    if default is None:
        raise SystemExit(f"--batch {spec!r} gives no batch for {devices} devices")
    return default


def part_time(con, args, sampler, tmp: Path, out: dict) -> None:
    from rich.table import Table

    from adaptdist.calibrate.local import load_cluster
    from bench_cost_model import wait_for_quiet

    models = [m for m in args.models.split(",") if m]
    layers = [int(x) for x in args.layers.split(",") if x]
    devices = [int(x) for x in args.devices.split(",") if x]
    for m in models:
        con.print(f"{m}: {model_config(m, 1)[2]}")
    clusters = {}
    for d in sorted(set(devices) | {HEADLINE["devices"]}):
        f = write_cluster_file(tmp / f"cluster-{d}.yaml", d)
        t0 = time.perf_counter()
        clusters[d] = load_cluster(f)
        con.print(f"cluster file {f.name}: {d} GPUs on {d // GPUS_PER_HOST} hosts, {f.stat().st_size / 1024:.0f} KiB, "
                  f"load_cluster {time.perf_counter() - t0:.2f} s")
    out["clusters"] = {d: str(tmp / f"cluster-{d}.yaml") for d in clusters}

    # ---- headline
    load, waited = wait_for_quiet(con, args.max_load, args.wait_s)
    con.print(f"load before the headline: {load:.2f} after waiting {waited:.0f} s")
    h = HEADLINE
    sampler.phase = "headline/capture"
    hc = capture_on_meta(h["model"], h["layers"], h["batch"])
    con.print(f"[bold]headline[/]: LLaMA-3-8B shapes, {h['layers']} layers ({hc.params / 1e9:.2f} B parameters), "
              f"global batch {h['batch']}, {h['devices']} GPUs; built on meta in {hc.build_s:.2f} s, captured in "
              f"{hc.capture_s:.2f} s ({hc.nodes} nodes; first capture in this process); "
              f"{sampler.summary(sampler.phase)}")
    head = {"build_s": hc.build_s, "capture_s": hc.capture_s, "nodes": hc.nodes, "params": hc.params}
    ht = Table(title=f"headline: LLaMA-3-8B shapes, {h['layers']} layers, {h['devices']} GPUs (8 hosts of 8), "
                     f"global batch {h['batch']} (seconds; predicted step in ms)")
    for col in ("mesh", "searcher", "capture", "graph", "solve", "plan", "after capture", "total", "chosen mesh",
                "pred step ms", "ILP status", "variables/axis", "outside load"):
        ht.add_column(col, justify="left" if col in ("mesh", "searcher", "chosen mesh", "ILP status") else "right")
    for mesh in (h["mesh"], None):
        for searcher in ("ilp", "random_walk"):
            sampler.phase = f"headline/{mesh or 'searched'}/{searcher}"
            r = run_planner(hc.graph, clusters[h["devices"]], searcher, mesh)
            total = hc.build_s + hc.capture_s + r.after_capture_s
            head[f"{mesh or 'searched'}/{searcher}"] = dict(r.to_dict(), total_s=total,
                                                            outside=sampler.outside(sampler.phase))
            ht.add_row(f"fixed {mesh}" if mesh else "searched", searcher, _s(hc.capture_s), _s(r.phases_s.get("graph", float("nan"))),
                       _s(r.phases_s.get("solve", float("nan"))), _s(r.phases_s.get("plan", float("nan"))),
                       _s(r.after_capture_s), _s(total), r.mesh or "-", _ms(r.step_s), r.status_text(),
                       str(r.variables), f"{sampler.outside(sampler.phase):.2f}")
    con.print(ht)
    fx = head[f"{h['mesh']}/ilp"]
    ok = lambda c: "[green]PASS[/]" if c else "[red]FAIL[/]"  # noqa: E731
    gap_ok = not fx["error"] and all(s[0] == "optimal" or s[1] <= TARGET_GAP for s in fx["statuses"].values())
    con.print(f"headline, mesh fixed at {h['mesh']}: total {fx['total_s']:.1f} s (target <= {TARGET_TOTAL_S:.0f} s: "
              f"{ok(fx['total_s'] <= TARGET_TOTAL_S)}); after capture {fx['after_capture_s']:.1f} s (target <= "
              f"{TARGET_AFTER_CAPTURE_S:.0f} s: {ok(fx['after_capture_s'] <= TARGET_AFTER_CAPTURE_S)}); per-axis ILPs "
              + ", ".join(f"{a} {s[0]} gap {100 * s[1]:.2g}%" for a, s in fx["statuses"].items())
              + f" (target optimal or gap <= {100 * TARGET_GAP:.0f}%: {ok(gap_ok)})")
    sr = head["searched/ilp"]
    con.print(f"headline, mesh searched: total {sr['total_s']:.1f} s, after capture {sr['after_capture_s']:.1f} s, "
              f"{sr['shapes_tried']} shapes, chose {sr['mesh']} ({_ms(sr['step_s'])} ms predicted); random walk "
              f"{head['searched/random_walk']['after_capture_s']:.1f} s, chose {head['searched/random_walk']['mesh']} "
              f"({_ms(head['searched/random_walk']['step_s'])} ms predicted)")
    con.print("  (per-axis optimality: each ILP is exact for its mesh axis with the other axes' choices held fixed; "
              "the joint choice is the coordinate-descent fixpoint, not a proven joint optimum)")
    head["targets"] = {"total": fx["total_s"] <= TARGET_TOTAL_S,
                       "after_capture": fx["after_capture_s"] <= TARGET_AFTER_CAPTURE_S, "gap": gap_ok}
    if args.profile:
        sampler.phase = "headline/profile"
        head["profile_fixed"] = profile_planner(con, hc.graph, clusters[h["devices"]], h["mesh"])
        head["profile_searched"] = profile_planner(con, hc.graph, clusters[h["devices"]], None)
    out["headline"] = head
    if args.headline_only:
        return

    # ---- grid
    rows = []
    t = Table(title="planner time, capture to plan (seconds; predicted step per rank in ms; rw = random walk)")
    for col in ("model", "layers", "GPUs", "batch", "capture", "graph", "solve", "plan", "total", "mesh",
                "pred ms", "ILP status", "vars/axis", "shapes", "rw solve", "rw mesh", "rw pred ms", "rw/ILP",
                "outside"):
        t.add_column(col, justify="left" if col in ("model", "mesh", "ILP status", "rw mesh") else "right",
                     no_wrap=col in ("mesh", "rw mesh", "ILP status", "outside"))
    keep = {(h["model"], h["layers"], h["batch"]): hc}
    for m in models:
        for L in layers:
            caps: dict[int, Captured] = {}
            for d in devices:
                b = batch_for(args.batch, d)
                if b not in caps:
                    sampler.phase = f"{m}/{L}/capture"
                    caps[b] = keep.get((m, L, b)) or capture_on_meta(m, L, b)
                    con.print(f"{m} {L} layers ({caps[b].params / 1e9:.2f} B parameters), batch {b}: captured in "
                              f"{caps[b].capture_s:.1f} s, {caps[b].nodes} nodes")
                c = caps[b]
                res = {}
                for searcher in ("ilp", "random_walk"):
                    sampler.phase = f"{m}/{L}/{d}/{searcher}"
                    res[searcher] = run_planner(c.graph, clusters[d], searcher)
                    res[searcher + "_outside"] = sampler.outside(sampler.phase)
                ilp, rw = res["ilp"], res["random_walk"]
                ph = ilp.phases_s
                total = c.capture_s + ilp.after_capture_s
                outside = max(res["ilp_outside"], res["random_walk_outside"])
                row = {"model": m, "layers": L, "devices": d, "batch": b, "capture_s": c.capture_s,
                       "nodes": c.nodes, "params": c.params, "ilp": ilp.to_dict(), "random_walk": rw.to_dict(),
                       "total_s": total, "rw_over_ilp": rw.step_s / ilp.step_s, "outside": outside}
                rows.append(row)
                t.add_row(m, str(L), str(d), str(b), _s(c.capture_s), _s(ph.get("graph", float("nan"))),
                          _s(ph.get("solve", ilp.wall_s)), _s(ph.get("plan", float("nan"))), _s(total),
                          ilp.mesh or "-", _ms(ilp.step_s), ilp.status_text(), str(ilp.variables),
                          str(ilp.shapes_tried), _s(rw.after_capture_s), rw.mesh or "-", _ms(rw.step_s),
                          "-" if rw.step_s != rw.step_s or ilp.step_s != ilp.step_s else f"{rw.step_s / ilp.step_s:.2f}",
                          f"{outside:.2f}" + (" DISTURBED" if outside > args.max_outside else ""))
                con.print(f"  {m} L={L} {d} GPUs: capture {c.capture_s:.1f} + graph {_s(ph.get('graph', float('nan')))} "
                          f"+ solve {_s(ph.get('solve', ilp.wall_s))} + plan {_s(ph.get('plan', float('nan')))} = "
                          f"{total:.1f} s; {ilp.mesh or ilp.error} {_ms(ilp.step_s)} ms; random walk "
                          f"{rw.after_capture_s:.1f} s {rw.mesh or rw.error} {_ms(rw.step_s)} ms; outside load {outside:.2f}"
                          + (f"; {ilp.reason}" if ilp.reason else ""))
            caps.clear()
    con.print(t)
    out["grid"] = rows


# --------------------------------------------------------------------------- part 2

def part_quality(con, args, sampler, tmp: Path, out: dict) -> None:
    from rich.table import Table
    from safetensors.torch import save_file

    from adaptdist.annotations import ManualPlan
    from adaptdist.calibrate.hardware import usable_cores
    from adaptdist.cluster_file import cluster_to_dict
    from adaptdist.compiler.capture import capture
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models import estimate_programs
    from adaptdist.models import gpt
    from adaptdist.program import save_programs
    from bench_cost_model import calibrate, default_plans, measure_plans, wait_for_quiet

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    worlds = tuple(int(w) for w in args.worlds.split(",") if w)
    cores = usable_cores()
    threads = {w: args.threads_per_rank or max(1, cores // w) for w in worlds}
    config = gpt.GPTConfig(num_heads=args.heads)
    con.print(f"plan quality: GPT (GPTConfig with {args.heads} heads), global batch {args.batch_size} x "
              f"{args.seq_len}, AdamW lr {args.lr}; worlds {worlds}, threads per rank {threads}; {args.rounds} "
              f"rounds x {args.steps} steps per plan")
    sampler.phase = "quality/compile"
    torch.manual_seed(args.seed)
    _, example, _ = gpt.factory(args.batch_size, args.seq_len, config)
    batch_file = str(tmp / "batch.safetensors")
    save_file({f"b{i}": x.contiguous() for i, x in enumerate(example)}, batch_file)
    hand = default_plans(worlds)
    dirs, compiled = {}, {}
    t0 = time.perf_counter()
    for p in hand:
        torch.manual_seed(args.seed)
        model, ex, loss_fn = gpt.factory(args.batch_size, args.seq_len, config)
        compiled[p.name] = compile_model(model, ex, loss_fn, p.world, ManualPlan.parse(p.plan, gpt),
                                           options=LoweringOptions(grad_bucket_bytes=int(p.bucket_mb * MIB)), mesh=p.mesh)
        dirs[p.name] = tmp / p.name.replace("/", "_").replace(" ", "_")
        save_programs(compiled[p.name], dirs[p.name])
    con.print(f"compiled {len(hand)} hand-written plans in {time.perf_counter() - t0:.1f} s")
    results = {}
    for w in worlds:
        sampler.phase = "idle"
        load, waited = wait_for_quiet(con, args.max_load, args.wait_s)
        con.print(f"world {w}: load {load:.2f} after waiting {waited:.0f} s")
        cluster = calibrate(con, sampler, w, threads[w])
        sampler.phase = f"plan/{w}"
        torch.manual_seed(args.seed)
        model, ex, loss_fn = gpt.factory(args.batch_size, args.seq_len, config)
        t0 = time.perf_counter()
        cap = capture(model, ex, loss_fn)
        r = plan_auto(cap, cluster, optimizer="adamw")
        plan_s = time.perf_counter() - t0
        auto = f"auto/{w}"
        compiled[auto] = compile_model(model, ex, loss_fn, w, r.plan, captured=cap)
        dirs[auto] = tmp / f"auto_{w}"
        save_programs(compiled[auto], dirs[auto])
        mesh = ",".join(f"{a}={n}" for a, n in r.plan.mesh.items())
        tried = "; ".join(f"{c} {'%.1f ms' % (1e3 * e.step_s) if not isinstance(e, str) else e}" for c, e in r.tried)
        sharded = sorted(r.plan.param_placements)
        con.print(f"world {w}: planner (capture + plan) {plan_s:.1f} s: mesh {mesh}, batch axis {r.plan.batch_axis}, "
                  f"predicted {1e3 * r.predicted.step_s:.1f} ms; shapes predicted: {tried}; {len(sharded)} parameters "
                  f"not replicated: {', '.join(sharded[:6])}{' ...' if len(sharded) > 6 else ''}")
        names = [p.name for p in hand if p.world == w] + [auto]
        # the cost model on the lowered programs, same cluster: what the planner's choice became after lowering
        est = {n: estimate_programs(compiled[n], cluster, "adamw").step_s for n in names}
        meas = measure_plans(con, sampler, w, [(n, dirs[n]) for n in names], batch_file, threads[w], args)
        hand_names = names[:-1]
        best = min(hand_names, key=lambda n: meas[n]["median_s"])
        ratio = meas[auto]["median_s"] / meas[best]["median_s"]
        per_round = [a / min(meas[n]["round_medians_s"][k] for n in hand_names)
                     for k, a in enumerate(meas[auto]["round_medians_s"])]
        outside = sampler.outside(f"measure/{w}")
        t = Table(title=f"plan quality on {w} local ranks (gloo, CPU): measured step ms, {args.rounds} alternating "
                        f"rounds x {args.steps} steps")
        for col in ("plan", "median ms", "spread (round medians)", "/ best hand plan", "cost model ms",
                    "planner predicted ms", "first loss"):
            t.add_column(col, justify="left" if col == "plan" else "right")
        for n in names:
            rm = meas[n]["round_medians_s"]
            t.add_row(n + (f" ({mesh})" if n == auto else "") + (" (best hand plan)" if n == best else ""),
                      _ms(meas[n]["median_s"]), f"{_ms(min(rm))}-{_ms(max(rm))}",
                      f"{meas[n]['median_s'] / meas[best]['median_s']:.3f}", _ms(est[n]),
                      _ms(r.predicted.step_s) if n == auto else "", f"{meas[n]['first_loss']:.4f}")
        con.print(t)
        ok = ratio <= TARGET_QUALITY
        con.print(f"world {w}: auto ({mesh}) / best hand plan ({best}) = {ratio:.3f} (per round {min(per_round):.3f}-"
                  f"{max(per_round):.3f}; target <= {TARGET_QUALITY}: {'[green]PASS[/]' if ok else '[red]FAIL[/]'})"
                  + (f" [red]DISTURBED (other people's runnable tasks {outside:.2f} on average)[/]"
                     if outside > args.max_outside else f"; outside load {outside:.2f}"))
        results[w] = {"meas": meas, "estimate_s": est, "best": best, "ratio": ratio, "ratio_per_round": per_round, "mesh": mesh,
                      "predicted_s": r.predicted.step_s, "plan_s": plan_s, "pass": ok, "outside": outside,
                      "tried": [(str(c), e if isinstance(e, str) else e.step_s) for c, e in r.tried],
                      "param_placements": {f: [repr(p) for p in pls] for f, pls in r.plan.param_placements.items()},
                      "cluster": cluster_to_dict(cluster)}
    out["quality"] = results


# --------------------------------------------------------------------------- main

def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("time", "quality", "all"), default="all")
    ap.add_argument("--headline-only", action="store_true", help="part 1: only the headline case")
    ap.add_argument("--quick", action="store_true", help="layers 2,8 on 8,64 GPUs; 2 rounds x 4 steps in part 2")
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--layers", default="2,8,32,96")
    ap.add_argument("--devices", default="8,64,1024", help="GPUs, multiples of 8 (hosts of 8)")
    ap.add_argument("--batch", default="16,1024:512",
                    help="global batch (sequences): a default and DEVICES:BATCH overrides")
    ap.add_argument("--profile", action="store_true", help="also run the headline under cProfile (not timed)")
    # part 2 (bench_cost_model's names, so its measure_plans reads them)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--breakdown-steps", type=int, default=1, help="bench_cost_model's breakdown (unused here)")
    ap.add_argument("--profile-steps", type=int, default=1, help="bench_cost_model's breakdown (unused here)")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    # both parts
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--wait-s", type=float, default=240.0)
    ap.add_argument("--max-outside", type=float, default=0.25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.devices, args.rounds, args.steps = "2,8", "8,64", 2, 4
    return args


def _git_state() -> tuple[str, list[str]]:
    """The checked-out commit and the files under adaptdist/ with uncommitted changes (others edit this tree)."""
    import subprocess

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "adaptdist").splitlines() if line.strip()]
    return git("rev-parse", "--short", "HEAD").strip() or "?", dirty


def main(argv=None) -> int:
    from rich.console import Console

    from bench_cost_model import LoadSampler

    t_imp = time.perf_counter()
    from adaptdist.compiler import capture as _capture, planner as _planner  # import time printed apart
    del _capture, _planner

    imp_s = time.perf_counter() - t_imp
    args = _parse(argv)
    con = Console(width=230)
    t_start = time.perf_counter()
    con.print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; torch {torch.__version__}; {os.cpu_count()} cores; "
              f"load {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min); importing the capture and "
              f"the planner took {imp_s:.1f} s (not counted below)")
    commit, dirty = _git_state()
    con.print(f"adaptdist at {commit}" + (f"; uncommitted changes in {', '.join(dirty)}" if dirty else ""))
    out: dict = {"args": vars(args), "import_s": imp_s, "commit": commit, "dirty": dirty}
    with LoadSampler() as sampler, tempfile.TemporaryDirectory(prefix="bench_planner-") as tmp:
        if args.part in ("time", "all"):
            part_time(con, args, sampler, Path(tmp), out)
        if args.part in ("quality", "all") and not args.headline_only:
            part_quality(con, args, sampler, Path(tmp), out)
        sampler.phase = "report"
    out["load"] = sampler.samples
    out["other_runnable"] = sampler.others
    con.print(f"now {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min); total "
              f"{time.perf_counter() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_planner

    sys.exit(bench_planner.main())
