"""What recognising ModuleList experts costs at capture (adaptdist/compiler/expert_lists.py): the built-in GPT
(its ``blocks`` list is a candidate the probe must look at, and finds a chain of layers) captured with the probe
and with it replaced by a no-op, alternating in one process; prints the medians and their ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_expert_probe.py [--reps 4] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import adaptdist.compiler.capture as cap
from adaptdist.compiler.expert_lists import ExpertLists
from adaptdist.models import gpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    real = cap.probe_expert_lists
    model, batch, loss = gpt.factory(args.batch, args.seq)
    cap.capture(model, batch, loss)  # warm-up
    times_s: dict[str, list[float]] = {"probe": [], "none": []}
    try:
        for _ in range(args.reps):
            for k in ("probe", "none"):
                cap.probe_expert_lists = real if k == "probe" else (lambda *a, **kw: ExpertLists())
                t0 = time.perf_counter()
                cap.capture(model, batch, loss)
                times_s[k].append(time.perf_counter() - t0)
    finally:
        cap.probe_expert_lists = real
    med = {k: statistics.median(v) for k, v in times_s.items()}
    print(f"GPT capture, median of {args.reps}: with the probe {med['probe']:.3f} s, without {med['none']:.3f} s, "
          f"ratio {med['probe'] / med['none']:.3f}")


if __name__ == "__main__":
    main()
