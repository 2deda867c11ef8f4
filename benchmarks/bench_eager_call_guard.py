"""The cost of adaptdist's eager-call guard (:func:`adaptdist.compiler.graphless_calls.refuse_eager_module_call`, a
forward pre-hook of every module, installed at the first frame compile of a job of several ranks), measured side by
side in one process, with and without the hook, alternating (A, B, A, B, ...) so machine noise hits both alike:

1. per module call in eager code (no compiled call running: the hook returns after one C call): ``nn.Identity()``
   called N times, the slowest path of a cheap module, as ns per call;
2. per module call in eager code that a torch.compile call with another backend runs (the hook looks up that
   backend): the same, inside a frame Dynamo skips;
3. an eager forward+backward of the built-in GPT (2 layers, 8x64 tokens), ms per step, and the ratio;
4. the Dynamo compile time of that GPT with the ``eager`` backend (tracing ``_call_impl`` of every module instead of
   its ``forward`` while any global hook exists), and the number of graphs.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_eager_call_guard.py [--calls 200000] [--repeats 7] [--compiles 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
from torch import nn


def _install() -> object:
    from adaptdist import _torch_compat as compat
    from adaptdist.compiler.graphless_calls import _eager_call_message, _world_size, refuse_eager_module_call

    return compat.install_global_forward_pre_hook(refuse_eager_module_call, (_world_size, _eager_call_message))


def _calls_ns(module: nn.Module, x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        module(x)
    return (time.perf_counter() - t0) / n * 1e9


def _under_compile(n: int):
    """A function Dynamo skips (``torch._dynamo.graph_break`` in a loop) that calls a module ``n`` times eagerly,
    compiled with the ``eager`` backend: the hook finds a compiled call running, of another backend."""
    ident = nn.Identity()

    def run(x):
        for _ in range(n):
            ident(x)
            torch._dynamo.graph_break()
        return x

    return torch.compile(run, backend="eager")


def _gpt():
    from adaptdist.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=128, num_layers=2, num_heads=4))


def _gpt_step_ms(model, tokens) -> float:
    t0 = time.perf_counter()
    model(tokens).float().pow(2).mean().backward()
    return (time.perf_counter() - t0) * 1e3


def _compile_s(tokens) -> tuple[float, int]:
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _gpt()
    t0 = time.perf_counter()
    torch.compile(model, backend=counting)(tokens)
    return time.perf_counter() - t0, len(graphs)


MODES = ("none", "trivial", "guard")  # no global hook; a global hook that does nothing; adaptdist's guard


def _set_mode(mode: str, handle: object) -> object:
    if handle is not None:
        handle.remove()
    if mode == "trivial":
        return torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    if mode == "guard":
        return _install()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compiles", type=int, default=3)
    args = ap.parse_args()
    import os
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
    torch.set_num_threads(1)
    load = os.getloadavg()
    ident, x = nn.Identity(), torch.zeros(1)
    tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    model = _gpt()
    loop_calls = 2000
    compiled_loop = _under_compile(loop_calls)
    compiled_loop(x)  # compiled (a skipped frame) outside the timing
    res = {k: {m: [] for m in MODES} for k in ("eager_ns", "compiled_ns", "gpt_ms", "compile_s")}
    graphs: dict[str, int] = {}
    handle = None
    for _ in range(args.repeats):
        for mode in MODES:
            handle = _set_mode(mode, handle)
            res["eager_ns"][mode].append(_calls_ns(ident, x, args.calls))
            t0 = time.perf_counter()
            compiled_loop(x)
            res["compiled_ns"][mode].append((time.perf_counter() - t0) / loop_calls * 1e9)
            res["gpt_ms"][mode].append(_gpt_step_ms(model, tokens))
    for _ in range(args.compiles):
        for mode in ("none", "guard"):
            handle = _set_mode(mode, handle)
            s, g = _compile_s(tokens)
            res["compile_s"][mode].append(s)
            graphs[mode] = g
    _set_mode("none", handle)
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in load)}; at end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for key, unit in (("eager_ns", "ns per nn.Identity call, eager"),
                      ("compiled_ns", "ns per nn.Identity call + graph break, in a call compiled with backend='eager'"),
                      ("gpt_ms", "ms per eager GPT forward+backward (2 layers, 8x64 tokens)"),
                      ("compile_s", "s to compile that GPT with a counting backend")):
        med = {m: statistics.median(v) for m, v in res[key].items() if v}
        parts = ", ".join(f"{m} {v:.4g} (x{v / med['none']:.2f})" for m, v in med.items())
        print(f"{unit}: {parts}")
    print(f"graphs of the GPT: without hook {graphs['none']}, with the guard {graphs['guard']}")


if __name__ == "__main__":
    main()
