"""Side-by-side step timings that a shared machine's changing load cannot bias: every side in the same processes,
one step of each in turn.

The other benchmarks (bench_dp, bench_fsdp, bench_tp) launch each side as its own job, one after the other; on the
2-core development machine shared with other work, the load changes between launches (1-minute load average
8 -> 24 within one run), and a side's median then says more about when it ran than about the side (bench_dp's
DDP side gave 157 ms in one repetition and 668 ms in the next). Here each rank builds every side first, then runs
step ``i`` of each side in turn (the order rotated each step, so no side always runs first or after the same
other), with a barrier before each step so that no side inherits the skew of the one before; each step is timed on
its own and the slowest rank's time counts (as in the other benchmarks). A step of side A and the next step of side
B are a fraction of a second apart, so both see the same load: the per-step *ratio* of two sides is the robust
figure (:func:`paired_ratios`), its median over steps what the tables report.

Sides are named builders ``"module:function"``: ``function(cfg, rank, world) -> step``, with
``step(global_batch) -> float`` (the loss) one training step; :func:`adaptdist_builder` is the one for compiled
adaptdist programs (``cfg["program_dirs"][comm]``). Memory is not measured in this mode (sides share a process).

Used by ``bench_dp.py --interleave`` (and bench_fsdp, bench_tp): :func:`run_interleaved` in the parent.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from typing import Callable


def chunked_step(module, opt, loss_fn: Callable, rank: int, world: int) -> Callable:
    """A torch side's step (bench_dp's no-comm and DDP sides, bench_fsdp's FSDP2 side): this rank's
    ``torch.chunk`` of the global batch ``(x, y)`` (rows on dim 0), forward, backward, optimizer step; returns this
    rank's loss (the parent averages over ranks)."""
    import torch

    def step(global_batch):
        x, y = (torch.chunk(t, world)[rank] for t in global_batch)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def adaptdist_builder(comm: str) -> Callable[[dict, int, int], Callable]:
    """A builder of adaptdist's step on the programs lowered with ``comm`` (``cfg["program_dirs"][comm]``): load the
    rank's program, register its groups (and the shared-memory ones its ops name), a StepRunner with AdamW."""

    def build(cfg: dict, rank: int, world: int) -> Callable:
        from adaptdist.program import load_program
        from adaptdist.runtime.worker import StepRunner, register_mesh_groups

        program = load_program(cfg["program_dirs"][comm], rank, world_size=world)
        register_mesh_groups(program, "gloo")
        return StepRunner(program, "adamw", cfg["lr"]).step

    return build


def build_adaptdist_shm(cfg: dict, rank: int, world: int) -> Callable:
    """adaptdist on the programs lowered with ``--comm shm``."""
    return adaptdist_builder("shm")(cfg, rank, world)


def build_adaptdist_gloo(cfg: dict, rank: int, world: int) -> Callable:
    """adaptdist on the programs lowered with ``--comm gloo``."""
    return adaptdist_builder("gloo")(cfg, rank, world)


def adaptdist_builders(program_dirs: dict[str, str]) -> dict[str, str]:
    """The adaptdist side(s): ``adaptdist`` (one transport) or ``adaptdist/shm`` and ``adaptdist/gloo``."""
    names = {"shm": "interleave:build_adaptdist_shm", "gloo": "interleave:build_adaptdist_gloo"}
    if len(program_dirs) == 1:
        return {"adaptdist": names[next(iter(program_dirs))]}
    return {f"adaptdist/{c}": names[c] for c in ("shm", "gloo") if c in program_dirs}


def _resolve(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def interleaved_worker(cfg: dict) -> dict:
    """One rank: build every side of ``cfg["builders"]`` (side -> ``"module:function"``), then
    ``cfg["warmup"] + cfg["steps"]`` rounds of one step per side (module docstring). Returns
    ``{side: {"times": [s per step], "losses": [...], "cpu_s": [process CPU s per step]}}`` (warm-up included)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        steps = {side: _resolve(spec)(cfg, rank, world) for side, spec in cfg["builders"].items()}
        t = load_file(cfg["batch_file"])
        batch = tuple(t[f"b{i}"] for i in range(len(t)))
        names = list(steps)
        out = {side: {"times": [], "losses": [], "cpu_s": []} for side in names}
        for i in range(cfg["warmup"] + cfg["steps"]):
            k = i % len(names)
            order = names[k:] + names[:k]
            if (i // len(names)) % 2:
                order = order[::-1]  # every side also comes after each other side
            for side in order:
                dist.barrier()
                c0 = time.process_time()
                t0 = time.perf_counter()
                loss = steps[side](batch)
                out[side]["times"].append(time.perf_counter() - t0)
                out[side]["cpu_s"].append(time.process_time() - c0)  # every thread of the process
                out[side]["losses"].append(float(loss))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def run_interleaved(con, builders: dict[str, str], cfg: dict, nproc: int, reps: int) -> tuple[dict, tuple, tuple, float]:
    """``reps`` launches of :func:`interleaved_worker` on ``nproc`` ranks. Returns ``(results, load before, load
    after, wall seconds)``, ``results[side]`` a list per launch of ``{rank: {"times", "losses"}}`` (the shape the
    benchmarks' ``_summarize`` reads, without memory)."""
    from adaptdist.runtime.launch import launch_local

    import interleave  # this module by name, so the spawned ranks can unpickle the worker

    results: dict[str, list] = {side: [] for side in builders}
    t_all = time.perf_counter()
    load_before = os.getloadavg()
    for rep in range(reps):
        t0 = time.perf_counter()
        res = launch_local(interleave.interleaved_worker, (dict(cfg, builders=builders),), nproc)
        for side in builders:
            results[side].append({r: res[r][side] for r in res})
        meds = {side: statistics.median(slowest_rank(results[side][-1])[cfg["warmup"]:]) for side in builders}
        con.print(f"rep {rep + 1}/{reps} (interleaved, {time.perf_counter() - t0:.1f} s): "
                  + ", ".join(f"{side} {1e3 * m:.1f} ms" for side, m in meds.items()))
    return results, load_before, os.getloadavg(), time.perf_counter() - t_all


def slowest_rank(res: dict[int, dict]) -> list[float]:
    """Per step, the slowest rank's time (seconds)."""
    ranks = sorted(res)
    return [max(res[r]["times"][i] for r in ranks) for i in range(len(res[ranks[0]]["times"]))]


def busiest_cpu(per_launch: list[dict[int, dict]], warmup: int) -> list[float]:
    """Per measured step (every launch), the largest CPU time (seconds) of any rank's process."""
    out = []
    for res in per_launch:
        ranks = sorted(res)
        out += [max(res[r]["cpu_s"][i] for r in ranks) for i in range(warmup, len(res[ranks[0]]["cpu_s"]))]
    return out


def paired_ratios(results: dict[str, list], a: str, b: str, warmup: int) -> list[float]:
    """Per measured step (every launch), side ``b``'s time over side ``a``'s in the same round: ``a``'s speedup over
    ``b`` (> 1: ``a`` faster)."""
    out = []
    for ra, rb in zip(results[a], results[b]):
        ta, tb = slowest_rank(ra)[warmup:], slowest_rank(rb)[warmup:]
        out += [y / x for x, y in zip(ta, tb)]
    return out


def ratio_line(results: dict[str, list], a: str, b: str, warmup: int) -> str:
    """``a`` over ``b``: the median per-round speedup, its quartiles, and how many rounds ``a`` won."""
    r = sorted(paired_ratios(results, a, b, warmup))
    q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
    return (f"{a} vs {b}: median per-round speedup {statistics.median(r):.3f}x (quartiles {q1:.3f}-{q3:.3f}; "
            f"{a} faster in {sum(x > 1 for x in r)}/{len(r)} rounds)")


def report(con, results: dict[str, list], args, tokens: int, torch_side: str, summarize, sides_table) -> dict:
    """Print the sides' table (``sides_table`` of ``summarize`` per side; ``torch_side`` the reference) and the
    per-round speedups: each adaptdist side over ``torch_side``, shm over gloo, and (bench_dp) ``no-comm`` over
    ``DDP``. Returns the summaries."""
    summaries = {side: summarize(res, args.warmup, tokens) for side, res in results.items()}
    sides_table(con, f"all sides, interleaved — {args.nproc} ranks x {args.threads_per_rank} thread(s), global batch "
                     f"{args.batch_size}x{args.seq_len}", summaries, torch_side)
    adaptdist = [s for s in results if s.startswith("adaptdist")]
    for a in adaptdist:
        con.print(ratio_line(results, a, torch_side, args.warmup))
    if {"adaptdist/shm", "adaptdist/gloo"} <= set(results):
        con.print(ratio_line(results, "adaptdist/shm", "adaptdist/gloo", args.warmup))
    con.print("CPU time per step (every thread of a rank's process; the busiest rank per round; median over rounds; "
              "what a loaded machine cannot inflate the way it inflates wall time): "
              + ", ".join(f"{s} {1e3 * statistics.median(busiest_cpu(results[s], args.warmup)):.1f} ms"
                          for s in results if "cpu_s" in next(iter(results[s][0].values()))))
    if {"no-comm", "DDP"} <= set(results):
        con.print(ratio_line(results, "no-comm", "DDP", args.warmup)
                  + " (DDP's exposed communication share = 1 - 1/speedup)")
    return summaries
