"""The torch.compile backend with and without one of its capture/runtime changes, side by side.

``--change fold`` (default):
vmap's addmm rule wrote each biased Linear's bias as ``mul(bias, 1)`` in the backend's all-ranks capture, which
hid the bias from the bucketing of parameter all_gathers: one all_gather per bias. ``before`` patches
``dynamo_capture.fold_unit_scalings`` to do nothing (what the capture was); ``after`` is the code as it is.
``--change loss``: ``before`` patches ``dynamo_backend.drop_backward_outputs`` to do nothing, so the backward part
computes the capture's unread scalar loss again (under dp with its scalar all_reduce).

Model: ``benchmarks/mha_encoder_model.py:factory`` (TransformerEncoderLayer(64, 4, batch_first) x 2 + heads),
global batch ``--batch-size`` x ``--seq-len`` on ``--nproc`` ranks (gloo or shm collectives: ``--comm``), SGD lr 0.01,
the README's loop (each rank its own rows). Each repetition launches both variants as separate jobs, in
alternating order; per step the slowest rank's time; reported: the median over the timed steps of each run, the
all_gathers per step and the last loss.

    .venv/bin/python benchmarks/bench_backend_bias_gathers.py [--nproc 2] [--batch-size 8] [--seq-len 128]
        [--steps 30] [--warmup 5] [--reps 3] [--plan fsdp] [--comm auto] [--change fold|loss]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def worker(variant: str, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import adaptdist
    import adaptdist.compiler.dynamo_capture as dc
    from mha_encoder_model import factory

    torch.set_num_threads(1)
    if variant == "before" and cfg["change"] == "fold":
        dc.fold_unit_scalings = lambda gm: 0
    if variant == "before" and cfg["change"] == "loss":
        import adaptdist.compiler.dynamo_backend as db

        db.drop_backward_outputs = lambda split, roles: split
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model, (x, y), loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        be = adaptdist.backend(plan=cfg["plan"], comm=cfg["comm"])
        compiled = torch.compile(model, backend=be, dynamic=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times, loss = [], None
        for s in range(cfg["warmup"] + cfg["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_fn(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if s >= cfg["warmup"]:
                times.append(float(t))
        calls = [c for step in be.compiled for c in step.collectives()]
        kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        backward = [str(n.target) for step in be.compiled for n in step.split.backward.graph.nodes
                    if n.op == "call_function" and any(k in str(n.target) for k in kinds)]
        return {"times": times, "loss": loss.item(), "gathers": sum("all_gather" in c for c in calls),
                "collectives": len(calls), "backward_collectives": len(backward)}
    finally:
        dist.destroy_process_group()


def _before(cfg):
    return worker("before", cfg)


def _after(cfg):
    return worker("after", cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--plan", default="fsdp")
    p.add_argument("--comm", default="auto")
    p.add_argument("--change", choices=("fold", "loss"), default="fold")
    args = p.parse_args()
    from adaptdist.runtime.launch import launch_local

    cfg = dict(batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
               plan=args.plan, comm=args.comm, change=args.change)
    sides = {"before": _before, "after": _after}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    print(f"load average {os.getloadavg()[0]:.2f}; {cfg}", flush=True)
    for rep in range(args.reps):
        for side in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            res = launch_local(sides[side], (cfg,), args.nproc)[0]
            res["median_ms"] = 1e3 * statistics.median(res["times"])
            results[side].append(res)
            print(f"rep {rep} {side}: median step {res['median_ms']:.2f} ms, {res['gathers']} all_gathers / "
                  f"{res['collectives']} collectives per step ({res['backward_collectives']} run in the backward), last loss {res['loss']:.8f}, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    b = [r["median_ms"] for r in results["before"]]
    a = [r["median_ms"] for r in results["after"]]
    print(f"before {', '.join(f'{v:.2f}' for v in b)} ms; after {', '.join(f'{v:.2f}' for v in a)} ms; "
          f"ratio of medians {statistics.median(b) / statistics.median(a):.3f}x", flush=True)


if __name__ == "__main__":
    main()
