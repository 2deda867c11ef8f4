"""Is a fused C++ gradient-bucket flatten/unflatten worth shipping? It must beat torch's own, into a
preallocated bucket: ``torch.cat(views, out=bucket)`` and ``torch._foreach_copy_(bucket_views, grads)`` to
flatten, ``torch._foreach_copy_(grads, bucket_views)`` to unflatten (issue 16: a kernel that does not win is
removed, not kept).

The candidate is built here (torch.utils.cpp_extension.load_inline, needs ninja and a C++ compiler): one op
that memcpys each contiguous tensor into (out of) the flat buffer at running offsets -- the least a fused
kernel can do. Cases: a GPT-2-like bucket (mixed sizes, 25 MiB), 1000 small tensors (1 KiB each), 64 large
ones (1 MiB each). Single thread; median of --reps timed loops.

    .venv/bin/python benchmarks/bench_bucket_flatten.py [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <cstring>
void flatten_into(std::vector<at::Tensor> ts, at::Tensor out) {
  char* dst = static_cast<char*>(out.data_ptr());
  for (auto& t : ts) { size_t b = t.numel() * t.element_size(); std::memcpy(dst, t.data_ptr(), b); dst += b; }
}
void unflatten_from(at::Tensor flat, std::vector<at::Tensor> ts) {
  const char* src = static_cast<const char*>(flat.data_ptr());
  for (auto& t : ts) { size_t b = t.numel() * t.element_size(); std::memcpy(t.data_ptr(), src, b); src += b; }
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flatten_into", &flatten_into);
  m.def("unflatten_from", &unflatten_from);
}
"""


def _cases() -> dict[str, list[int]]:
    gpt2 = []
    for _ in range(12):  # per layer: ln, attn qkv (+bias), proj (+bias), ln, mlp fc (+bias), proj (+bias), 768 wide
        gpt2 += [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768]
    numel, bucket = 0, []
    for n in gpt2:  # first 25 MiB
        if (numel + n) * 4 > 25 << 20:
            break
        bucket.append(n)
        numel += n
    return {"gpt2_bucket_25MiB": bucket, "1000x1KiB": [256] * 1000, "64x1MiB": [1 << 18] * 64}


def _time(fn, reps: int) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    fn()
    iters = max(3, int(0.2 / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    from torch.utils.cpp_extension import load_inline

    torch.set_num_threads(1)
    ext = load_inline("adaptdist_bench_flatten", cpp_sources=SOURCE, extra_cflags=["-O3"],
                      build_directory=tempfile.mkdtemp(prefix="adaptdist-flatten-"), verbose=False)
    print(f"load average: {os.getloadavg()}")
    print(f"{'case':<20}{'tensors':>8}{'MiB':>7} | flatten us: {'cat(out=)':>10}{'foreach':>10}{'C++':>10}"
          f"{'C++/best':>9} | unflatten us: {'foreach':>10}{'C++':>10}{'C++/best':>9}")
    for name, sizes in _cases().items():
        grads = [torch.randn(n) for n in sizes]
        flat = torch.empty(sum(sizes))
        views = list(torch.split(flat, sizes))
        src_views = [g.view(-1) for g in grads]
        t_cat = _time(lambda: torch.cat(src_views, out=flat), args.reps)
        t_fe = _time(lambda: torch._foreach_copy_(views, grads), args.reps)
        t_cpp = _time(lambda: ext.flatten_into(grads, flat), args.reps)
        ext.flatten_into(grads, flat)
        assert torch.equal(flat, torch.cat(src_views))
        u_fe = _time(lambda: torch._foreach_copy_(grads, views), args.reps)
        u_cpp = _time(lambda: ext.unflatten_from(flat, grads), args.reps)
        print(f"{name:<20}{len(sizes):>8}{sum(sizes) * 4 / 2**20:>7.1f} | {'':>12}{t_cat * 1e6:>10.1f}"
              f"{t_fe * 1e6:>10.1f}{t_cpp * 1e6:>10.1f}{t_cpp / min(t_cat, t_fe):>9.2f} | {'':>14}{u_fe * 1e6:>10.1f}"
              f"{u_cpp * 1e6:>10.1f}{u_cpp / u_fe:>9.2f}")
    print("C++/best < 1 means the fused kernel is faster than torch's best way")


if __name__ == "__main__":
    main()
