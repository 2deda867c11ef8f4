"""The per-step cost of the backend's graph agreement (:mod:`adaptdist.runtime.graph_agreement`: one 16-byte
``all_gather`` before the forward and one before the backward of every compiled graph), measured side by side on
2 gloo ranks: training steps of a model through ``torch.compile(backend=adaptdist.backend(plan=...))`` with the
announcements on and switched off (the function replaced by a no-op on every rank at the same step), in
alternating blocks (on, off, on, off, ...) so machine noise hits both alike; and the announcement alone, back to
back. Cases: the built-in GPT (2 layers, dim 128, 8x64 tokens per rank; one graph) under dp, and a small MLP (one
graph; the agreement's share of a cheap step) under dp (one announcement per step) and fsdp (two).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_graph_agreement.py [--blocks 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


CASES = (("gpt", "dp"), ("mlp", "dp"), ("mlp", "fsdp"))  # fsdp: the forward communicates, two announcements


def _worker(blocks: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import adaptdist
    from adaptdist.runtime import graph_agreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    real = graph_agreement.announce
    out = {}
    try:
        for name, plan in CASES:
            torch._dynamo.reset()
            torch.manual_seed(0)
            if name == "gpt":
                from adaptdist.models.gpt import GPT, GPTConfig

                model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=128, num_layers=2, num_heads=4))
                x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(rank))
                loss_fn = lambda m: m(x).float().pow(2).mean()  # noqa: E731
            else:
                model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
                y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(rank))
                loss_fn = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
            compiled = torch.compile(model, backend=adaptdist.backend(plan=plan), dynamic=False)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for _ in range(3):  # compile, first steps
                loss_fn(compiled).backward()
                opt.step()
                opt.zero_grad()
            times = {"on": [], "off": []}
            for b in range(2 * blocks):
                mode = "on" if b % 2 == 0 else "off"
                graph_agreement.announce = real if mode == "on" else (lambda *a, **k: None)
                dist.barrier()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss_fn(compiled).backward()
                    opt.step()
                    opt.zero_grad()
                    times[mode].append((time.perf_counter() - t0) * 1e3)
            graph_agreement.announce = real
            out[f"{name} {plan}"] = {m: statistics.median(v) for m, v in times.items()}
        dist.barrier()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            real(graph_agreement.FORWARD, 12345, lambda: "bench")
        out["announce_ms"] = (time.perf_counter() - t0) / n * 1e3
        return out
    finally:
        graph_agreement.announce = real
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from adaptdist.runtime.launch import launch_local

    t0 = time.perf_counter()
    results = launch_local(_worker, (args.blocks, args.steps), 2)
    print(f"2 gloo ranks, {args.blocks} blocks x {args.steps} steps per mode, medians ({time.perf_counter() - t0:.0f} s)")
    print("| model | rank | ms/step with agreement | without | difference ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, plan in CASES:
        for r in (0, 1):
            on, off = results[r][f"{name} {plan}"]["on"], results[r][f"{name} {plan}"]["off"]
            print(f"| {name} {plan} | {r} | {on:.2f} | {off:.2f} | {on - off:+.2f} | {on / off:.3f} |")
    print(f"one announcement alone (all_gather of int64[2]), back to back: rank 0 {results[0]['announce_ms']:.3f} ms, "
          f"rank 1 {results[1]['announce_ms']:.3f} ms")


if __name__ == "__main__":
    main()
