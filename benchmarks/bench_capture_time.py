"""Capture time of the built-in GPT (``adaptdist/models/gpt.py``'s ``factory(8, 64)``): one warm-up capture, then
N timed ones (seconds each and their median). Usage: ``python benchmarks/bench_capture_time.py [N]`` (default 7)."""

import statistics
import sys
import time

import adaptdist.models.gpt as gpt
from adaptdist.compiler.capture import capture


def main(reps: int = 7) -> None:
    model, batch, loss = gpt.factory(8, 64)
    capture(model, batch, loss)  # warm: imports, torch's caches
    times_s = []
    for _ in range(reps):
        t = time.perf_counter()
        capture(model, batch, loss)
        times_s.append(time.perf_counter() - t)
    print("capture_s", " ".join(f"{t:.3f}" for t in times_s), "median", f"{statistics.median(times_s):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
