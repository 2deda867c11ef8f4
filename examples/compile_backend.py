"""Train the built-in GPT with ``torch.compile(model, backend="adaptdist")`` in an ordinary training loop.

    adaptdist launch --nproc 2 examples/compile_backend.py [--plan auto|dp|fsdp] [--steps 30] [--out DIR]
    torchrun --nproc-per-node 2 examples/compile_backend.py         # the same

Each rank reads its own rows of every global batch (DDP's input contract) from Python's standard
library source (bytes), and runs the loop below unchanged; adaptdist plans, shards and communicates.
With ``--out DIR`` each rank writes its losses to ``DIR/rank{r}.json`` and rank 0 writes the model's full
state dict (``adaptdist.full_state_dict``) to ``DIR/model.pt``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import adaptdist
from adaptdist.data.text import ByteCorpus
from adaptdist.models.gpt import GPT, GPTConfig, lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(GPTConfig(dim=64, num_layers=2, num_heads=4, max_seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compiled = torch.compile(model, backend=adaptdist.backend(plan=args.plan), dynamic=False)

    batches = ByteCorpus.embedded().batches(args.batch_size, args.seq_len, seed=1)  # same on every rank
    losses = []
    for step in range(args.steps):
        x, y = next(batches)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's rows
        loss = lm_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.3f} (rank 0's rows)", flush=True)
    state = adaptdist.full_state_dict(compiled, rank0_only=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses,
                                                          "local_numel": sum(p.numel() for p in model.parameters())}))
        if rank == 0:
            torch.save(state, out / "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
