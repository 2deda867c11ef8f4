"""The torch.compile backend on one rank of a device, against eager on the same device (device_check.sh).

    PYTHONPATH=. python benchmarks/device_check_backend.py [--device cuda|cpu] [--steps 3]

One process, a process group of one rank (``cpu:gloo,cuda:nccl`` for cuda, as ``adaptdist train`` makes it), the
built-in GPT (small) on ``--device``: ``torch.compile(model, backend=adaptdist.backend(plan="dp"))`` and an eager
copy trained side by side with SGD on the same batches. Prints each step's two losses; exits 1 when they differ by
more than 1e-3 relative (the compiled step's attention is captured with the math kernel, eager's may be a fused one).
"""

from __future__ import annotations

import argparse
import copy
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import adaptdist
    from adaptdist.data.text import ByteCorpus
    from adaptdist.models.gpt import GPT, GPTConfig, lm_loss
    from adaptdist.runtime.devices import process_group_backend

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(process_group_backend([args.device]), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=64, num_layers=2, num_heads=4, max_seq_len=64)).to(device)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=adaptdist.backend(plan="dp"), dynamic=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    batches = ByteCorpus.embedded().batches(8, 64, seed=1)
    worst = 0.0
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in next(batches))
        losses = []
        for m, opt in zip((compiled, eager), opts):
            loss = lm_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        rel = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-12)
        worst = max(worst, rel)
        print(f"step {step + 1}: backend {losses[0]:.6f}  eager {losses[1]:.6f}  (rel diff {rel:.2e})", flush=True)
    on = {p.device.type for p in model.parameters()}
    print(f"backend on {device} ({', '.join(sorted(on))} parameters): {args.steps} steps in "
          f"{time.perf_counter() - t0:.1f} s, worst loss difference {worst:.2e} relative", flush=True)
    dist.destroy_process_group()
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
