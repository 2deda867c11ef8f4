"""Heterogeneity-aware data parallelism vs an even split, on real unequal ranks of this machine, in one run.

3 gloo ranks: ranks 0 and 1 pinned to core 0 (``cpus: [0]`` in the cluster file: they share it, each at about
half a core), rank 2 alone on core 1 (``cpus: [1]``). The cluster is first measured with those pins
(``adaptdist.calibrate.profile.profile_local(base=...)``, what ``adaptdist cluster profile --cluster FILE``
runs), so the planner sees rank 2 at about twice the FLOP/s of the others. The model is compute-dominated: a
wide-batch MLP (``WideBatchMLP``: 6 x Linear(256, 256) + ReLU, 395k parameters, 1.5 MiB of gradients; 4096 rows of
256 features per step; MSE loss; SGD), about 9.7 GFLOP per step against one 1.5 MiB all_reduce.

Two program sets of the same plan (dp on 3 ranks) are compiled: ``even`` (torch.chunk: 1366/1366/1364 rows)
and ``hetero`` (``place_on_devices``: rows by each device's measured speed, about 1024/1024/2048), and a third,
``adaptive``: hetero re-balanced in the run (``adaptdist.runtime.rebalance``, what ``train`` does), and a fourth,
``fixed``: the profiled split re-measured at its own rows and re-split until it stops moving
(``adaptdist.device_assignment.fixed_point_rows``, at most ``--fixed-rounds`` measurements of ``--fixed-steps``
steps after as many untimed ones, each rank's compute = step minus waits, all ranks at once; each round logged), since a rank's speed per row
depends on its rows (RESULTS.md, "bench_hetero with twice the rows"). Its prediction: the compute it measured at
its final rows plus the cost model's communication. They run in ONE process group. The target's figure: ``--reps`` interleaved repetitions, each blocks A B B A (then B A A B) of
``--steps`` steps of each plan back to back (no barrier per step, as a training loop), one ratio per repetition
(even's seconds / the plan's). Beside it: barrier-timed steps (rank 0's wall time between two barriers), the
predicted step time of each plan (the cost model on the measured cluster), per rank and step its compute (step
minus waits on collectives), waits and CPU / wall (are the two ranks on core 0 given equal halves?), per core and
per repetition the share other processes took (/proc/stat minus our ranks' CPU), and the all_reduce alone.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_hetero.py [--rows 4096] [--width 256] [--layers 6]
        [--steps 16] [--reps 5] [--barrier-reps 1] [--measure-steps 10] [--rebalance-rounds 1]
        [--fixed-rounds 3] [--fixed-steps 16] [--fixed-min-gain 0.02] [--quick-profile]
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


class WideBatchMLP(nn.Module):
    """``layers`` x (Linear(width, width) + ReLU): little to all-reduce, much to compute per row."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.net(x)


def build(rows: int, width: int, layers: int):
    torch.manual_seed(0)
    model = WideBatchMLP(width, layers)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g))
    return model, batch, F.mse_loss


def cluster_yaml(path: Path, mem_bytes: int) -> None:
    dev = ("{{rank: {r}, kind: cpu, cpus: [{c}], peak_flops: {{float32: 1.0e+10}}, memory_bytes: %d, "
           "memory_bandwidth_bytes_per_s: 5.0e+9}}" % mem_bytes)
    path.write_text("schema_version: 2\nhosts:\n  - name: localhost\n    devices:\n"
                    + "".join(f"      - {dev.format(r=r, c=c)}\n" for r, c in ((0, 0), (1, 0), (2, 1)))
                    + "links:\n  - {tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}\n"
                      "calibration: null\n")


# --------------------------------------------------------------------------- worker (one per rank)

def worker(cfg: dict) -> dict:
    from adaptdist.program import load_program
    from adaptdist.runtime.affinity import pin_to_cpus
    from adaptdist.runtime.worker import StepRunner, register_mesh_groups

    rank = int(os.environ["RANK"])
    pin_to_cpus(cfg["cpus"][rank], rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    try:
        from safetensors.torch import load_file

        t = load_file(cfg["batch_file"])
        batch = (t["b0"], t["b1"])
        runners = {}
        for name in ("hetero", "even"):
            program = load_program(cfg["dirs"][name], rank, world_size=3)
            register_mesh_groups(program, "gloo")
            runners[name] = StepRunner(program, "sgd", 1e-3)

        runners_local, local_batches = {}, {}
        for name in ("hetero", "even"):
            program = load_program(cfg["local_dirs"][name][rank], 0, world_size=1)
            runners_local[name] = StepRunner(program, "sgd", 1e-3)
            off, n = runners[name].program.batch_slice
            local_batches[name] = tuple(t.narrow(0, off, n).contiguous() for t in batch)

        from adaptdist.runtime.trace import TraceRecorder

        fixed_point = None
        if cfg["fixed_rounds"]:
            # the fixed point (adaptdist.device_assignment.fixed_point_rows): start from the profiled split, measure
            # every rank's compute at the rows it gets (the 3-rank programs, steps minus waits, all ranks at once),
            # re-split by the speed per row measured at those rows, lower again, until the split stops moving
            from adaptdist.device_assignment import fixed_point_rows
            from adaptdist.runtime.rebalance import ComputeMeter, compute_summary

            current = {"dir": cfg["dirs"]["hetero"]}
            got0: list = [None] * 3
            dist.all_gather_object(got0, runners["hetero"].program.batch_slice[1])
            current["rows"] = tuple(got0)
            current["runner"] = StepRunner(load_program(current["dir"], rank, world_size=3), "sgd", 1e-3)

            def measure(rows: tuple[int, ...]) -> list[float]:
                if rows != current["rows"]:
                    answer: list = [None]
                    if rank == 0:
                        answer[0] = _lower_rows(cfg, rows, f"fixed{len(fixed_log)}")
                    dist.broadcast_object_list(answer, src=0)
                    current.update(rows=rows, dir=answer[0],
                                   runner=StepRunner(load_program(answer[0], rank, world_size=3), "sgd", 1e-3))
                meter = ComputeMeter(current["runner"])
                k = cfg["fixed_steps"]
                dist.barrier()
                for i in range(k):  # back to back, as the timed blocks and a training loop run (no barrier a step)
                    with meter.step(i):
                        current["runner"].step(batch)
                dist.barrier()
                own = compute_summary(meter, range(1, k))  # the first step after a swap warms up
                meter.detach()
                got: list = [None] * 3
                dist.all_gather_object(got, own)
                fixed_log.append({"rows": list(rows), "compute_s": [g[0] for g in got], "noise": [g[1] for g in got]})
                return [g[0] for g in got]

            fixed_log: list[dict] = []
            for _ in range(cfg["fixed_steps"]):  # warm the processes first: a fresh rank's first window is slow
                dist.barrier()
                current["runner"].step(batch)
            res_fp = fixed_point_rows(cfg["rows"], current["rows"], measure, max_rounds=cfg["fixed_rounds"],
                                      min_gain=cfg["fixed_min_gain"])
            if res_fp.rows != current["rows"]:  # not settled: the best measured split
                measure(res_fp.rows)
            fixed_point = {"rows": list(res_fp.rows), "converged": res_fp.converged, "rounds": fixed_log,
                           "measured_s": list(res_fp.measured_s), "lines": res_fp.lines(), "dir": current["dir"]}
            if rank == 0:
                print("rank 0: fixed point of the split:\n  " + "\n  ".join(res_fp.lines()), flush=True)
            runners["fixed"] = StepRunner(load_program(current["dir"], rank, world_size=3), "sgd", 1e-3)

        rebalances = []
        if cfg["rebalance_rounds"]:
            # the runtime's re-balance (adaptdist.runtime.rebalance, as `adaptdist train` runs it): start from the
            # profiled split, measure each rank's compute in the run, re-split, move the state over
            from adaptdist.runtime.rebalance import ComputeMeter, agree, compute_summary, transfer_state

            runner = StepRunner(load_program(cfg["dirs"]["hetero"], rank, world_size=3), "sgd", 1e-3)
            directory = cfg["dirs"]["hetero"]
            k = cfg["measure_steps"]
            for rnd in range(cfg["rebalance_rounds"]):
                meter = ComputeMeter(runner)
                for i in range(k):
                    dist.barrier()
                    with meter.step(i):
                        runner.step(batch)
                own = compute_summary(meter, range(1, k))  # the first step after a swap warms up
                meter.detach()
                decision, path, err = agree(rank, 3, own, lambda m, e, d=directory, n=rnd: _decide_and_lower(
                    cfg, d, m, e, (n + 1) * k, n))
                rebalances.append(decision.to_doc() if decision is not None else {"error": err})
                if path is None:
                    break
                new = StepRunner(load_program(path, rank, world_size=3), "sgd", 1e-3)
                transfer_state(runner, new)
                runner, directory = new, path
            runners["adaptive"] = runner

        recs = {}
        for name in runners:  # each rank's compute and its waits on the all_reduce, per step
            recs[name] = TraceRecorder(rank)
            runners[name].use_trace(recs[name])
            recs[name].align_clocks()
        step_no = {name: 0 for name in runners}

        def timed(name: str) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            with recs[name].step(step_no[name]):
                runners[name].step(batch)
            step_no[name] += 1
            dist.barrier()
            return time.perf_counter() - t0

        names = tuple(runners)
        for name in names:
            for _ in range(cfg["warmup"]):
                timed(name)
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(cfg["barrier_reps"]):  # barrier-timed steps (rank 0's wall between two barriers)
            for name in (names if rep % 2 == 0 else names[::-1]):
                times[name] += [timed(name) for _ in range(cfg["steps"])]
        first_b2b = dict(step_no)

        def block(name: str, n: int) -> tuple[float, list[float], list[float]]:
            """n steps back to back, as a training loop runs them (no barrier per step): wall seconds of the block
            (between two barriers), and this rank's wall and CPU seconds per step (CPU: every thread of it)."""
            walls, cpus = [], []
            dist.barrier()
            stat0 = _proc_stat_cpu()
            t0 = t_prev = time.perf_counter()
            c_prev = time.process_time()
            for _ in range(n):
                with recs[name].step(step_no[name]):
                    runners[name].step(batch)
                step_no[name] += 1
                t, c = time.perf_counter(), time.process_time()
                walls.append(t - t_prev)
                cpus.append(c - c_prev)
                t_prev, c_prev = t, c
            dist.barrier()
            wall = time.perf_counter() - t0
            # this block's core seconds (machine-wide, read by every rank alike) and this rank's CPU seconds
            hz = os.sysconf("SC_CLK_TCK")
            stat1 = _proc_stat_cpu()
            busy = {c: (sum(stat1[c]) - stat1[c][3] - stat1[c][4] - stat1[c][7]
                        - (sum(stat0[c]) - stat0[c][3] - stat0[c][4] - stat0[c][7])) / hz
                    for c in stat0 if c != "cpu" and c in stat1}
            block_cores.append({"busy_s": busy, "cpu_s": sum(cpus), "wall_s": wall})
            return wall, walls, cpus

        # interleaved repetitions: each is A B B A (or B A A B) of `steps` steps each, so a linear drift of the
        # machine's speed over the repetition weighs both plans alike; its ratio is even's seconds / the other's
        blocks: dict[str, list[float]] = {name: [] for name in names}
        block_cores: list[dict] = []
        per_step: dict[str, dict[str, list[float]]] = {name: {"wall_s": [], "cpu_s": []} for name in names}
        reps: list[dict[str, float]] = []
        for rep in range(cfg["reps"]):
            order = names if rep % 2 == 0 else names[::-1]
            acc = {name: 0.0 for name in names}
            for name in order + order[::-1]:
                wall, walls, cpus = block(name, cfg["steps"])
                acc[name] += wall
                per_step[name]["wall_s"] += walls
                per_step[name]["cpu_s"] += cpus
            for name in names:
                blocks[name].append(acc[name] / (2 * cfg["steps"]))
            reps.append({name: acc[name] / (2 * cfg["steps"]) for name in names})
        # each rank's own compute, all ranks at once: a one-rank program of its rows, no collectives
        own: dict[str, list[float]] = {"hetero": [], "even": []}
        for rep in range(min(cfg["reps"], 2)):
            for name in (("hetero", "even") if rep % 2 == 0 else ("even", "hetero")):
                local = runners_local[name]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg["steps"]):
                    local.step(local_batches[name])
                own[name].append((time.perf_counter() - t0) / cfg["steps"])
        # each rank's matmul rate during the run, all ranks at once (the heterogeneity actually present)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            torch.mm(a, b)
        in_run_gflops = 200 * 2 * 256**3 / (time.perf_counter() - t0) / 1e9
        grad = torch.zeros(cfg["num_params"])
        comm = []
        for _ in range(10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(grad)
            comm.append(time.perf_counter() - t0)
        split = {}
        for name, rec in recs.items():  # timed steps only (the warm-up's are the first ones)
            waits: dict[int, float] = {}
            for sp in rec.spans:
                if sp.kind == "wait":
                    waits[sp.step] = waits.get(sp.step, 0.0) + sp.duration_s
            steps = [s for s in rec.steps if s.step >= first_b2b[name]]  # the interleaved repetitions' steps
            split[name] = {"compute_s": [s.duration_s - waits.get(s.step, 0.0) for s in steps],
                           "wait_s": [waits.get(s.step, 0.0) for s in steps], **per_step[name]}
        from adaptdist.runtime.worker import program_transports

        return {"times": times, "blocks": blocks, "reps": reps, "block_cores": block_cores, "split": split, "transports": program_transports(runners["hetero"].program), "rebalances": rebalances, "fixed_point": fixed_point, "all_reduce_s": statistics.median(comm), "threads": torch.get_num_threads(),
                "in_run_gflops": in_run_gflops, "own_compute_s": {k: statistics.median(v) for k, v in own.items()},
                "affinity": sorted(os.sched_getaffinity(0)), "process_cpu_s": time.process_time()}
    finally:
        dist.destroy_process_group()


def _decide_and_lower(cfg: dict, directory: str, measured_s: list[float], noise: list[float], step: int,
                      round_: int):
    """Rank 0: the re-balance's decision for the programs in ``directory`` and, when it applies, their lowering
    with the new rows (the one door: compile_model with explicit rows on the measured cluster)."""
    from adaptdist.calibrate.local import load_cluster
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.program import load_program, save_programs
    from adaptdist.compiler.rebalance_rows import decide

    programs = {r: load_program(directory, r, world_size=3) for r in range(3)}
    cluster = load_cluster(cfg["cluster_file"])
    decision = decide(programs, cluster, measured_s, "sgd", step, noise=noise)
    print(f"rank 0: {decision.line()}", flush=True)
    if not decision.applied:
        return decision, None
    model, batch, loss_fn = build(cfg["rows"], cfg["width"], cfg["layers"])
    from adaptdist.comm_transport import rank_hosts

    opts = LoweringOptions(comm=cfg["comm"], hosts=rank_hosts(cluster))
    new = compile_model(model, batch, loss_fn, 3, programs[0].plan, opts, cluster=cluster,
                        optimizer="sgd", batch_split=decision.rows_after)
    return decision, str(save_programs(new, Path(cfg["tmp"]) / f"adaptive{round_}"))


def _lower_rows(cfg: dict, rows: tuple[int, ...], name: str) -> str:
    """Rank 0: the dp programs lowered with ``rows`` per rank on the measured cluster (the one door:
    compile_model with explicit rows), saved under ``name``; their directory."""
    from adaptdist.calibrate.local import load_cluster
    from adaptdist.comm_transport import rank_hosts
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.program import load_program, save_programs

    cluster = load_cluster(cfg["cluster_file"])
    plan = load_program(cfg["dirs"]["hetero"], 0, world_size=3).plan
    model, batch, loss_fn = build(cfg["rows"], cfg["width"], cfg["layers"])
    opts = LoweringOptions(comm=cfg["comm"], hosts=rank_hosts(cluster))
    new = compile_model(model, batch, loss_fn, 3, plan, opts, cluster=cluster, optimizer="sgd",
                        batch_split=tuple(rows))
    return str(save_programs(new, Path(cfg["tmp"]) / name))


# --------------------------------------------------------------------------- driver

def _proc_stat_cpu() -> dict[str, list[int]]:
    """CPU jiffies from /proc/stat (user nice system idle iowait irq softirq steal), for the machine ("cpu") and
    each core ("cpu0", ...); {} off Linux."""
    try:
        return {ln.split()[0]: [int(x) for x in ln.split()[1:9]]
                for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("cpu")}
    except (OSError, ValueError):
        return {}


def _others_share(res: dict, n_plans: int) -> list[dict[str, float]]:
    """Per repetition (4 blocks of each of ``n_plans`` plans), per core: (core busy seconds - our ranks' CPU
    seconds on it) / wall seconds, from each block's /proc/stat reads and each rank's CPU time."""
    per_rep = 2 * n_plans
    n_blocks = len(res[0]["block_cores"])
    out = []
    for start in range(0, n_blocks, per_rep):
        idx = range(start, min(start + per_rep, n_blocks))
        wall = sum(res[0]["block_cores"][i]["wall_s"] for i in idx)
        share = {}
        for core in res[0]["block_cores"][start]["busy_s"]:
            busy = sum(res[0]["block_cores"][i]["busy_s"][core] for i in idx)
            ours = sum(res[r]["block_cores"][i]["cpu_s"] / len(res[r]["affinity"])
                       for r in range(3) for c in res[r]["affinity"] if f"cpu{c}" == core for i in idx)
            share[core] = round((busy - ours) / wall, 3)
        out.append(share)
    return out


def _ratio_noise(per_rank: list[list[float]]) -> dict:
    """Per step, rank 2's compute / the mean of ranks 0 and 1's: its median, and the coefficients of variation of
    that ratio and of each rank's compute (a ratio far steadier than its parts: the noise is common to the ranks)."""
    n = min(len(x) for x in per_rank)
    ratio = [per_rank[2][i] / ((per_rank[0][i] + per_rank[1][i]) / 2) for i in range(n)]

    def cv(xs):
        return round(statistics.pstdev(xs) / statistics.mean(xs), 3)

    return {"median": round(statistics.median(ratio), 3), "cv_ratio": cv(ratio),
            "cv_per_rank": [cv(x[:n]) for x in per_rank]}


def _stat_delta(a: dict, b: dict, ours_s: dict[str, float]) -> dict:
    """Per core ("cpu0", ...) and for the machine, between two /proc/stat reads: busy seconds, the shares busy,
    idle and stolen (by the hypervisor), and ``others_s``: busy seconds not spent by our ranks (``ours_s``: the
    ranks' CPU seconds on that core) -- other processes, the launcher, the kernel."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for cpu in a:
        if cpu not in b:
            continue
        d = [y - x for x, y in zip(a[cpu], b[cpu])]
        total = sum(d) or 1
        busy = total - d[3] - d[4] - d[7]
        out[cpu] = {"busy_s": round(busy / hz, 2), "busy": round(busy / total, 3),
                    "idle": round((d[3] + d[4]) / total, 3), "steal": round(d[7] / total, 3)}
        if cpu in ours_s:
            out[cpu]["ours_s"] = round(ours_s[cpu], 2)
            out[cpu]["others_s"] = round(busy / hz - ours_s[cpu], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16, help="steps per block")
    ap.add_argument("--reps", type=int, default=5,
                    help="interleaved repetitions (each: blocks A B B A, back to back; the order alternates)")
    ap.add_argument("--barrier-reps", type=int, default=1, help="blocks of barrier-timed steps of each")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--comm", choices=("auto", "gloo", "shm"), default="auto",
                    help="the collectives' transport, as train's --comm (auto: shared memory on one host)")
    ap.add_argument("--rebalance-rounds", type=int, default=1,
                    help="re-balances of the 'adaptive' set (0: no adaptive set; the runtime's default is 1)")
    ap.add_argument("--measure-steps", type=int, default=10,
                    help="steps before each re-balance (the first not measured; train's --rebalance-after auto)")
    ap.add_argument("--fixed-rounds", type=int, default=3,
                    help="measurements of the 'fixed' set's fixed point (0: no fixed set): the profiled split "
                         "re-measured at its own rows and re-split until it stops moving")
    ap.add_argument("--fixed-steps", type=int, default=16,
                    help="steps measured per round of the fixed point (the first not counted)")
    ap.add_argument("--fixed-min-gain", type=float, default=0.02,
                    help="the fixed point stops when the next split's predicted gain is under 1 + this")
    ap.add_argument("--quick-profile", action="store_true", help="short profile windows (noisier figures)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE", help="also write the numbers here")
    args = ap.parse_args()

    from safetensors.torch import save_file

    from adaptdist.calibrate.local import load_cluster
    from adaptdist.calibrate.profile import profile_local
    from adaptdist.cluster_file import save_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.device_placement import place_on_devices
    from adaptdist.compiler.lowering import lower, resolve_plan
    from adaptdist.cost_models.estimate import estimate_programs
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-hetero-") as tmp:
        tmp = Path(tmp)
        cluster_yaml(tmp / "cluster.yaml", 4 * 2**30)
        base = load_cluster(tmp / "cluster.yaml")
        t0 = time.perf_counter()
        quick = dict(target_s=0.005, repeats=2, compute_window_s=0.3, elementwise_bytes=16 * 2**20) \
            if args.quick_profile else dict(compute_window_s=0.6)
        prof = profile_local(3, "cpu", (4096, 65536, 2**20), base=base, compute_dtypes=("float32",), **quick)
        cluster = prof.cluster
        save_cluster(cluster, tmp / "measured.yaml")
        profile_s = time.perf_counter() - t0
        flops = [cluster.device(r).peak_flops["float32"] for r in range(3)]
        print(f"profiled with cpus [0], [0], [1] in {profile_s:.0f} s: float32 GFLOP/s "
              f"{[round(f / 1e9, 2) for f in flops]}")

        model, batch, loss_fn = build(args.rows, args.width, args.layers)
        named = {k: v.detach() for k, v in model.named_parameters()}
        cg = capture(model, batch, loss_fn)
        state = {f: named[f] for f in cg.input_fqns}
        plan = resolve_plan(None, cg, 3)
        from adaptdist.comm_transport import rank_hosts

        # the transport `adaptdist train` takes (--comm auto: shared memory between the ranks of one host)
        opts = LoweringOptions(comm=args.comm, hosts=rank_hosts(cluster))
        sets, preds, rows = {}, {}, {}
        for name, split in (("hetero", "auto"), ("even", "even")):
            placed, programs = place_on_devices(cg, plan, cluster, opts, lower, state=state, optimizer="sgd",
                                                batch_split=split)
            est = estimate_programs(programs, cluster, "sgd")
            sets[name] = str(save_programs(programs, tmp / name))
            preds[name] = est
            rows[name] = [p.batch_slice[1] for p in programs.values()]
        local_dirs = {}
        for name in ("hetero", "even"):
            local_dirs[name] = []
            for r, n in enumerate(rows[name]):
                m1, b1, l1 = build(n, args.width, args.layers)
                cg1 = capture(m1, b1, l1)
                st1 = {f: dict(m1.named_parameters())[f].detach() for f in cg1.input_fqns}
                local_dirs[name].append(str(save_programs(lower(cg1, resolve_plan(None, cg1, 1), LoweringOptions(), state=st1),
                                                          tmp / f"{name}-local{r}")))
        save_file({"b0": batch[0].contiguous(), "b1": batch[1].contiguous()}, str(tmp / "batch.safetensors"))
        num_params = sum(p.numel() for p in model.parameters())
        cfg = dict(cpus=[cluster.device(r).cpus for r in range(3)], dirs=sets, local_dirs=local_dirs, batch_file=str(tmp / "batch.safetensors"),
                   warmup=args.warmup, steps=args.steps, reps=args.reps, barrier_reps=args.barrier_reps, timeout_s=args.timeout_s,
                   num_params=num_params, rebalance_rounds=args.rebalance_rounds, measure_steps=args.measure_steps,
                   fixed_rounds=args.fixed_rounds, fixed_steps=args.fixed_steps, fixed_min_gain=args.fixed_min_gain,
                   cluster_file=str(tmp / "measured.yaml"), rows=args.rows, width=args.width, layers=args.layers,
                   tmp=str(tmp), comm=args.comm)
        t0, cpu0 = time.perf_counter(), _proc_stat_cpu()
        res = launch_local(worker, (cfg,), 3)
        run_s, cpu1 = time.perf_counter() - t0, _proc_stat_cpu()
        fp = res[0]["fixed_point"]
        if fp is not None:  # the fixed point's programs, priced as the others (the cost model on the profile)
            from adaptdist.program import load_program

            fx = {r: load_program(fp["dir"], r, world_size=3) for r in range(3)}
            preds["fixed"] = estimate_programs(fx, cluster, "sgd")
            rows["fixed"] = [p.batch_slice[1] for p in fx.values()]
        done = [d for d in res[0]["rebalances"] if d.get("applied")]
        if done:  # the adaptive set's last programs, priced as the others
            from adaptdist.program import load_program

            ad = {r: load_program(tmp / f"adaptive{len(done) - 1}", r, world_size=3) for r in range(3)}
            preds["adaptive"] = estimate_programs(ad, cluster, "sgd")
            rows["adaptive"] = [p.batch_slice[1] for p in ad.values()]
        elif "adaptive" in res[0]["times"]:
            preds["adaptive"], rows["adaptive"] = preds["hetero"], rows["hetero"]
    load_after = os.getloadavg()
    r0 = res[0]
    ours: dict[str, float] = {}
    for r in range(3):
        for c in res[r]["affinity"]:
            ours[f"cpu{c}"] = ours.get(f"cpu{c}", 0.0) + res[r]["process_cpu_s"] / len(res[r]["affinity"])
    med = {k: statistics.median(v) for k, v in r0["times"].items()} if args.barrier_reps else \
        {k: statistics.median(v) for k, v in r0["blocks"].items()}
    ratio = med["even"] / med["hetero"]
    names = tuple(med)
    out = {
        "model": f"WideBatchMLP({args.width}x{args.layers}), {num_params} params, {args.rows} rows, MSE, SGD",
        "measured_gflops": [f / 1e9 for f in flops],
        "rows": rows,
        "measured_step_ms": {k: 1e3 * v for k, v in med.items()},
        "measured_step_ms_per_block": {k: [round(1e3 * statistics.median(v[i:i + args.steps]), 1)
                                           for i in range(0, len(v), args.steps)] for k, v in r0["times"].items()},
        "transports": r0["transports"],
        "measured_step_ms_quartiles": {k: [1e3 * q for q in statistics.quantiles(v, n=4)] for k, v in r0["times"].items()},
        "predicted_step_ms": {k: 1e3 * e.step_s for k, e in preds.items()},
        "predicted_comm_ms": {k: 1e3 * max(x.communication_s for x in e.ranks.values()) for k, e in preds.items()},
        "speedup_measured": ratio,
        # steps back to back (no barrier per step), blocks alternating: the median block's mean step
        "measured_block_step_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in r0["blocks"].items()},
        "speedup_measured_blocks": statistics.median(r0["blocks"]["even"]) / statistics.median(r0["blocks"]["hetero"]),
        "speedup_measured_blocks_adaptive": (statistics.median(r0["blocks"]["even"])
                                             / statistics.median(r0["blocks"]["adaptive"])
                                             if "adaptive" in r0["blocks"] else None),
        "speedup_measured_adaptive": med["even"] / med["adaptive"] if "adaptive" in med else None,
        "speedup_predicted_adaptive": preds["even"].step_s / preds["adaptive"].step_s if "adaptive" in preds else None,
        "rebalances": r0["rebalances"],
        # the fixed point: each round's rows and measured compute per rank; its own prediction of the step is the
        # compute measured at its final rows plus the cost model's communication
        "fixed_point": ({k: v for k, v in r0["fixed_point"].items() if k != "dir"}
                        if r0["fixed_point"] is not None else None),
        "predicted_step_ms_fixed_point": (1e3 * (max(r0["fixed_point"]["measured_s"]) + max(
            x.communication_s for x in preds["fixed"].ranks.values())) if r0["fixed_point"] is not None else None),
        # ...and of the even split from the same measurements (each rank's time per row at the fixed point's rows)
        "predicted_step_ms_fixed_point_even": (1e3 * (max(t / n * e for t, n, e in zip(
            r0["fixed_point"]["measured_s"], r0["fixed_point"]["rows"], rows["even"])) + max(
            x.communication_s for x in preds["even"].ranks.values())) if r0["fixed_point"] is not None else None),
        "in_run_gflops": [res[r]["in_run_gflops"] for r in range(3)],
        "own_compute_ms": {k: [1e3 * res[r]["own_compute_s"][k] for r in range(3)] for k in ("hetero", "even")},
        "compute_only_speedup": max(res[r]["own_compute_s"]["even"] for r in range(3))
        / max(res[r]["own_compute_s"]["hetero"] for r in range(3)),
        "ideal_speedup_profiled": sum(flops) / (3 * min(flops)),
        "ideal_speedup_in_run": sum(res[r]["in_run_gflops"] for r in range(3)) / (3 * min(res[r]["in_run_gflops"]
                                                                                       for r in range(3))),
        "speedup_predicted": preds["even"].step_s / preds["hetero"].step_s,
        # per rank, median over the timed steps: its own compute (step minus waits) and its waits on collectives
        "per_rank_compute_ms": {k: [1e3 * statistics.median(res[r]["split"][k]["compute_s"]) for r in range(3)]
                                for k in names},
        "per_rank_compute_iqr_ms": {k: [[round(1e3 * q, 1) for q in statistics.quantiles(res[r]["split"][k]["compute_s"], n=4)[::2]]
                                        for r in range(3)] for k in names},
        "per_rank_wait_ms": {k: [1e3 * statistics.median(res[r]["split"][k]["wait_s"]) for r in range(3)]
                             for k in names},
        "predicted_compute_ms": {k: [1e3 * e.ranks[r].compute_s for r in range(3)] for k, e in preds.items()},
        "all_reduce_ms_measured": 1e3 * r0["all_reduce_s"],
        "threads_affinity": [(res[r]["threads"], res[r]["affinity"]) for r in range(3)],
        # the interleaved repetitions (A B B A, steps back to back): even's step / each plan's, per repetition
        "repetitions_speedup": {k: [round(rp["even"] / rp[k], 3) for rp in r0["reps"]] for k in names if k != "even"},
        "repetitions_step_ms": [{k: round(1e3 * v, 2) for k, v in rp.items()} for rp in r0["reps"]],
        # per rank, median over the repetitions' steps: CPU seconds of the process / wall seconds of the step
        # (ranks 0 and 1 share core 0: about 0.5 each while both compute)
        "per_rank_cpu_share": {k: [round(statistics.median(c / w for c, w in zip(res[r]["split"][k]["cpu_s"],
                                                                             res[r]["split"][k]["wall_s"])), 3)
                                   for r in range(3)] for k in names},
        "per_rank_step_cpu_ms": {k: [round(1e3 * statistics.median(res[r]["split"][k]["cpu_s"]), 2) for r in range(3)]
                                 for k in names},
        "per_rank_wall_cv": {k: [round(statistics.pstdev(res[r]["split"][k]["wall_s"])
                                       / statistics.mean(res[r]["split"][k]["wall_s"]), 3) for r in range(3)]
                             for k in names},
        # per repetition: the share of each core that went to anything but our ranks (other processes, the kernel)
        "repetitions_others_share": _others_share(res, len(names)),
        # per step of the repetitions: the lone rank's compute / the mean of the two sharing core 0 (median, and
        # its coefficient of variation beside each rank's own): how much of the step-to-step noise all ranks share
        "per_step_compute_ratio": {k: _ratio_noise([res[r]["split"][k]["compute_s"] for r in range(3)]) for k in names},
        # the hypervisor's steal and other processes: /proc/stat over the 3-rank run
        "proc_stat_run": _stat_delta(cpu0, cpu1, ours),
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "profile_s": profile_s, "run_s": run_s,
    }
    print(json.dumps(out, indent=1))
    print(f"hetero rows {rows['hetero']} vs even {rows['even']}: measured {med['hetero'] * 1e3:.1f} vs "
          f"{med['even'] * 1e3:.1f} ms/step = {ratio:.3f}x (target >= 1.25, ideal 4/3); predicted "
          f"{out['predicted_step_ms']['hetero']:.1f} vs {out['predicted_step_ms']['even']:.1f} ms = "
          f"{out['speedup_predicted']:.3f}x; ideal for the speeds measured (profile / during the run) "
          f"{out['ideal_speedup_profiled']:.3f}x / {out['ideal_speedup_in_run']:.3f}x; compute alone (each rank's "
          f"rows, all at once, slowest rank) {out['compute_only_speedup']:.3f}x; gradient all_reduce alone {out['all_reduce_ms_measured']:.2f} ms "
          f"({100 * r0['all_reduce_s'] / med['hetero']:.1f}% of the hetero step); load average "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores")
    if "fixed" in med:
        print(f"fixed point (profiled rows re-measured at their own rows and re-split, {len(r0['fixed_point']['rounds'])} "
              f"measurements, {'settled' if r0['fixed_point']['converged'] else 'not settled'}) rows {rows['fixed']}: "
              f"measured {med['fixed'] * 1e3:.1f} vs even {med['even'] * 1e3:.1f} ms/step = "
              f"{med['even'] / med['fixed']:.3f}x; predicted (its measured compute + the cost model's communication) "
              f"{out['predicted_step_ms_fixed_point']:.1f} ms vs even {out['predicted_step_ms_fixed_point_even']:.1f} ms "
              f"= {out['predicted_step_ms_fixed_point_even'] / out['predicted_step_ms_fixed_point']:.3f}x; (the cost "
              f"model on the profile) {out['predicted_step_ms']['fixed']:.1f} ms")
        for line in r0["fixed_point"]["lines"]:
            print(f"  {line}")
    if "adaptive" in med:
        print(f"adaptive (profiled rows, re-balanced in the run after {args.measure_steps} steps) rows "
              f"{rows['adaptive']}: measured {med['adaptive'] * 1e3:.1f} vs even {med['even'] * 1e3:.1f} ms/step = "
              f"{out['speedup_measured_adaptive']:.3f}x (target >= 1.25); predicted "
              f"{out['predicted_step_ms']['adaptive']:.1f} ms = {out['speedup_predicted_adaptive']:.3f}x")
    print(f"steps back to back (no barrier per step; median of {args.reps} blocks): even / hetero "
          f"{out['speedup_measured_blocks']:.3f}x, even / adaptive {out['speedup_measured_blocks_adaptive'] or 0:.3f}x")
    for k, v in out["repetitions_speedup"].items():
        own = (f" (cost model on the profile); {out['predicted_step_ms_fixed_point_even'] / out['predicted_step_ms_fixed_point']:.3f}x "
               "from the fixed point's own measurements") if k == "fixed" else ""
        print(f"interleaved repetitions (A B B A, back to back), even / {k}: {v}: {sum(x >= 1.25 for x in v)} of "
              f"{len(v)} >= 1.25, median {statistics.median(v):.3f}x; predicted "
              f"{preds['even'].step_s / preds[k].step_s:.3f}x{own}")
    print(f"per repetition, the share of each core used by others: {out['repetitions_others_share']}")
    print(f"per step, lone rank's compute / the core-0 ranks' mean: {out['per_step_compute_ratio']}")
    print(f"CPU share per rank (cpu / wall per step): {out['per_rank_cpu_share']}; /proc/stat over the run: "
          f"{out['proc_stat_run']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    import bench_hetero  # noqa: F401  (the ranks unpickle the worker by this module name)

    sys.exit(bench_hetero.main())
