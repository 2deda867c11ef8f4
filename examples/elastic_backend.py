"""Train the built-in GPT with the adaptdist torch.compile backend, checkpointing so that a restart resumes.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/elastic_backend.py --out runs/elastic [--plan fsdp]
    adaptdist launch --nproc 2 examples/elastic_backend.py --out runs/elastic       # the same, no restarts

Every ``--checkpoint-every`` steps (and after the last) the ranks write ``adaptdist.save_checkpoint`` under
``--out``/checkpoints (the newest ``--keep`` kept); at the start they ``adaptdist.load_checkpoint`` the
newest good one, if any. When a rank dies, torchrun (``--max-restarts``) restarts every rank, and the run
goes on from that checkpoint; run the same command again after a crash past its restarts (or with a larger
``--steps``) and it continues too. The data position is the step: the global batch of step ``s`` is drawn
from seed ``(--seed, s)``, and each rank takes its rows of it, so a resumed run sees exactly the batches an
uninterrupted one would, at any world size that divides ``--batch-size`` (the checkpoint loads under any
plan and number of ranks).

Outputs under ``--out``: ``checkpoints/step-XXXXXXXX``; at the end, on rank 0, ``final.pt`` (the full state
dict, ``adaptdist.full_state_dict``) and ``summary.json`` (steps, the step this attempt resumed from, its
losses). Rank 0 prints ``resumed from step N`` when it resumes.

Test hook: with ``ADAPTDIST_TEST_KILL_AT_STEP=k`` in the environment, rank 1 kills itself (SIGKILL) just
before step ``k`` of the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0), so that a test can
check the resume (tests/test_backend_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import adaptdist
from adaptdist.data.text import ByteCorpus
from adaptdist.models.gpt import GPT, GPTConfig, lm_loss


def init_process_group(timeout: timedelta) -> None:
    """``dist.init_process_group("gloo")``, with the keys of each torchrun attempt under their own prefix.

    Under torchrun (torch 2.13), the rendezvous's TCPStore outlives a restart, and the process group of the
    next attempt would read the previous attempt's gloo addresses from it ("Gloo connectFullMesh failed ...
    Connection refused", or a hang; torch's rendezvous.py assumes a new store per attempt). Setting
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun is the other way out.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def batch_of_step(corpus: ByteCorpus, step: int, batch_size: int, seq_len: int, seed: int):
    """The global batch of ``step`` (the same on every rank, in every attempt)."""
    return next(corpus.batches(batch_size, seq_len, seed=seed * 1_000_003 + step))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default="auto", help="auto, dp, fsdp, tp, ... (adaptdist.backend(plan=))")
    ap.add_argument("--steps", type=int, default=30, help="total steps of the run (a resumed run counts the done ones)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="save a checkpoint every N steps")
    ap.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints")
    ap.add_argument("--out", required=True, help="directory for checkpoints/, final.pt and summary.json")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (sequences), split over the ranks")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout (seconds)")
    args = ap.parse_args()

    init_process_group(timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} does not split evenly over {world} ranks: pass a multiple "
                         f"of {world}")
    out = Path(args.out)
    ckpt = out / "checkpoints"
    torch.manual_seed(args.seed)  # the same initial model on every rank (a resume overwrites it)
    model = GPT(GPTConfig(dim=64, num_layers=2, num_heads=4, max_seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compiled = torch.compile(model, backend=adaptdist.backend(plan=args.plan), dynamic=False)

    resumed = adaptdist.load_checkpoint(ckpt, compiled, opt)  # None: nothing to resume
    start = resumed[0] if resumed else 0
    if rank == 0:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"rank 0: {world} ranks, attempt {attempt}, " +
              (f"resumed from step {start}" if resumed else "starting at step 0"), flush=True)

    kill_at = os.environ.get("ADAPTDIST_TEST_KILL_AT_STEP")  # test hook (module docstring)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    corpus = ByteCorpus.embedded()
    losses = {}
    for step in range(start, args.steps):
        if kill_at is not None and int(kill_at) == step and rank == 1 and first_attempt:
            print(f"rank 1 killing itself at step {step} (ADAPTDIST_TEST_KILL_AT_STEP)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_of_step(corpus, step, args.batch_size, args.seq_len, args.seed)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's rows
        loss = lm_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        done = step + 1
        if done % args.checkpoint_every == 0 or done == args.steps:
            adaptdist.save_checkpoint(ckpt, compiled, opt, step=done, extra={"loss": losses[step]}, keep=args.keep)
        if rank == 0 and (step % 10 == 0 or done == args.steps):
            print(f"step {done}/{args.steps}  loss {loss.item():.3f} (rank 0's rows)", flush=True)

    state = adaptdist.full_state_dict(compiled, rank0_only=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "final.pt.tmp")
        os.replace(out / "final.pt.tmp", out / "final.pt")
        (out / "summary.json").write_text(json.dumps({"steps": args.steps, "resumed_from": start if resumed else None,
                                                      "world_size": world, "plan": args.plan, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
