"""builtin:dlrm on MovieLens: the validation RMSE after each of N epochs and the time, in single-process eager
PyTorch on the batches `adaptdist train builtin:dlrm` draws (the same factory, seed, AdamW and shuffled epochs),
beside one `adaptdist train` of the same N epochs on local gloo ranks, run after it.

    .venv/bin/python benchmarks/bench_dlrm.py [--data DIR] [--epochs 2] [--batch-size 256] [--lr 2e-3]
                                              [--nproc 2] [--plan dp] [--threads 1]

``--data`` defaults to builtin:dlrm's (``../shared/data/movielens-small``, else a generated data set of its shape).
Figures: benchmarks/RESULTS.md, "builtin:dlrm on MovieLens".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def eager(args) -> list[dict]:
    """One process: per epoch, the mean training loss, the validation RMSE and the seconds it took."""
    sys.path.insert(0, str(ROOT))
    from adaptdist.data import movielens as ml
    from adaptdist.models import dlrm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, _, loss_fn = dlrm.factory(args.batch_size, 1, data_path=args.data)
    data = ml.resolve(args.data)
    per_epoch = ml.steps_per_epoch(data.split()[0].numel(), args.batch_size)
    batches = dlrm.data(args.batch_size, 1, path=args.data, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0, total = time.perf_counter(), 0.0
        for _ in range(per_epoch):
            batch = next(batches)
            loss = loss_fn(model(*batch[:-1]), batch[-1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        train_s = time.perf_counter() - t0
        fields, _ = dlrm.evaluate(model, args.data)
        rows.append({"epoch": epoch, "train_mse": total / per_epoch, "validation_rmse": fields["validation_rmse"],
                     "mean_baseline_rmse": fields["mean_baseline_rmse"], "train_s": train_s,
                     "samples_per_s": per_epoch * args.batch_size / train_s, "steps": per_epoch * epoch})
    return rows


def distributed(args, steps: int) -> dict:
    """`adaptdist train builtin:dlrm` for ``steps`` steps; its summary.json and the command's wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "builtin:dlrm", "--plan", args.plan, "--nproc",
               str(args.nproc), "--steps", str(steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
               "--seed", str(args.seed), "--threads-per-rank", str(args.threads), "--checkpoint-every", "1000000",
               "--out", tmp]
        if args.data:
            cmd += ["--data", args.data]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        return {**json.loads((Path(tmp) / "summary.json").read_text()), "command_wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--plan", default="dp")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the eager process and of each rank")
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()}")
    rows = eager(args)
    for r in rows:
        print(f"eager epoch {r['epoch']}: train MSE {r['train_mse']:.4f}, validation RMSE {r['validation_rmse']:.4f} "
              f"(training mean: {r['mean_baseline_rmse']:.4f}), {r['train_s']:.1f} s, {r['samples_per_s']:,.0f} "
              "samples/s")
    s = distributed(args, rows[-1]["steps"])
    ev = s["evaluation"]
    print(f"adaptdist train --plan {args.plan} on {s['ranks']} ranks, {ev['epochs']:.2f} epochs: validation RMSE "
          f"{ev['validation_rmse']:.4f} (eager: {rows[-1]['validation_rmse']:.4f}), median step "
          f"{1e3 * s['step_time_s']:.1f} ms, {s['samples_per_s']:,.0f} samples/s (eager "
          f"{rows[-1]['samples_per_s']:,.0f}: x{s['samples_per_s'] / rows[-1]['samples_per_s']:.2f}), train "
          f"{s['wall_s']:.0f} s, command {s['command_wall_s']:.0f} s")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
