"""The cost of ``rng="global"`` (every rank draws every random tensor whole) against ``rng="per-rank"``, measured in
one run: a Hugging Face GPT-2 built from a config (random weights, no download) in training mode, dropout 0.1 on
the embeddings, the attention probabilities, the attention output and the MLP output of every layer, trained
through ``torch.compile(backend=adaptdist.backend(plan="dp", rng=...))`` on gloo ranks. Both models are compiled
in the same processes and their steps alternate (A, B, A, B, ...), so machine noise hits both alike; warm-up
steps are excluded; per step the time is the slowest rank's. Reported: the median step time of each, their
ratio, and the random numbers each rank draws per step under each mode.

    .venv/bin/python benchmarks/bench_rng.py [--nproc 2] [--batch-per-rank 4] [--seq-len 64] [--steps 12]

The workers live in this module; the ``__main__`` block imports this file as the module ``bench_rng`` (its
directory is put on ``sys.path`` and ``PYTHONPATH``) so that the spawned ranks can unpickle them by name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=256,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                      bos_token_id=0, eos_token_id=0)).train()


def worker(batch_per_rank: int, seq_len: int, steps: int, warmup: int, timeout_s: float = 300.0) -> dict:
    import torch.nn.functional as F

    import adaptdist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randint(0, 256, (batch_per_rank, seq_len), generator=g)
        y = torch.randint(0, 256, (batch_per_rank, seq_len), generator=g)
        runs, backends = {}, {}
        for mode in ("per-rank", "global"):
            model = _gpt2(0)
            backends[mode] = adaptdist.backend(plan="dp", rng=mode)
            runs[mode] = (model, torch.compile(model, backend=backends[mode], fullgraph=True),
                          torch.optim.SGD(model.parameters(), lr=1e-3))
        torch.manual_seed(0)  # the same on every rank: rng="global" checks it
        times = {m: [] for m in runs}
        for step in range(warmup + steps):
            for mode, (model, compiled, opt) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                out = compiled(x)
                F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).backward()
                opt.step()
                opt.zero_grad()
                dist.barrier()
                if step >= warmup:
                    times[mode].append(time.perf_counter() - t0)
        slowest = {}
        for mode, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[mode] = t.tolist()
        colls = {m: [c.split("(")[0] for s in be.compiled for c in s.collectives()] for m, be in backends.items()}
        return {"times": slowest, "collectives": {m: {k: c.count(k) for k in sorted(set(c))} for m, c in colls.items()}}
    finally:
        dist.destroy_process_group()


def random_numbers_per_rank(batch_per_rank: int, seq_len: int, world: int, layers: int = 2, d: int = 128,
                            heads: int = 4) -> dict:
    """Random numbers one rank draws per step: the dropout masks of its rows (per-rank) or of all rows (global)."""
    per_row = seq_len * d + layers * (heads * seq_len * seq_len + 2 * seq_len * d)
    return {"per-rank": batch_per_rank * per_row, "global": world * batch_per_rank * per_row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch-per-rank", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from adaptdist.runtime.launch import launch_local

    import bench_rng

    res = launch_local(bench_rng.worker, (args.batch_per_rank, args.seq_len, args.steps, args.warmup), args.nproc)[0]
    med = {m: statistics.median(ts) for m, ts in res["times"].items()}
    n = random_numbers_per_rank(args.batch_per_rank, args.seq_len, args.nproc)
    print(f"HF GPT-2 (2 layers, d=128, 4 heads, dropout 0.1), {args.nproc} ranks x {args.batch_per_rank} x "
          f"{args.seq_len} tokens, plan dp, SGD, 1 thread per rank, median of {args.steps} steps:")
    for m in med:
        print(f"  rng={m:8s} {1e3 * med[m]:8.1f} ms/step  ({n[m]:,} random numbers per rank per step; collectives "
              f"{res['collectives'][m]})")
    print(f"  global / per-rank: {med['global'] / med['per-rank']:.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    main()
