"""Hugging Face models (``benchmarks/hf_pp_models.py``) under pipeline plans through ``adaptdist train``, each
against single-process eager PyTorch (issue 15 with issue 14's models).

For each model and mode: ``adaptdist train benchmarks/hf_pp_models.py:NAME --plan pp --microbatches M`` on 2 ranks
(``pp``) or with ``--mesh pp=2,dp=2`` on 4 ranks (``pp2dp2``), SGD, ``--steps`` steps on the factory's example
batch; eager runs the same steps in this process. Recorded: equal (every step's loss and every SGD-updated
parameter within 1e-5), the largest absolute difference, or the error's last line. Gradients are compared by
the one-process simulation (``--simulate``: ``compile_model`` + ``simulate_pipeline``, loss, every gradient and
the updated parameters, as tests/test_pipeline_lowering.py's ``check_against_eager``).

Usage: python benchmarks/bench_hf_pp.py [--models bart,gpt2] [--modes pp,pp2dp2] [--microbatches 2] [--steps 2]
Each launch costs 15-60 s on 2 loaded cores; run it under /tmp/lead/heavy on the shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hf_pp_models  # noqa: E402

B, T, LR = 8, 8, 0.1
MODES = {"pp": ["--plan", "pp", "--nproc", "2"], "pp2dp2": ["--plan", "pp", "--mesh", "pp=2,dp=2", "--nproc", "4"]}


def eager(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batch, loss_fn = getattr(hf_pp_models, name)(B, T)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(name: str, mode: str, microbatches: int, steps: int, out: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "adaptdist.cli", "train", f"{HERE / 'hf_pp_models.py'}:{name}", *MODES[mode],
           "--microbatches", str(microbatches), "--batch-size", str(B), "--seq-len", str(T), "--optimizer", "sgd",
           "--lr", str(LR), "--steps", str(steps), "--sample-bytes", "0", "--threads-per-rank", "1", "--out", str(out)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "wall_s": timeout_s}
    rec = {"wall_s": round(time.monotonic() - t0, 1), "command": " ".join(["adaptdist", *cmd[3:]])}
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else f"rc {p.returncode}")
        return {**rec, "outcome": "error", "error": err[:400]}
    from safetensors.torch import load_file

    want_losses, want_params = eager(name, steps)
    got_losses = json.loads((out / "summary.json").read_text())["losses"]
    got_params = load_file(str(out / "model.safetensors"))
    diffs = [abs(a - b) for a, b in zip(got_losses, want_losses)]
    missing = sorted(set(want_params) - set(got_params))
    diffs += [(got_params[n] - w).abs().max().item() for n, w in want_params.items() if n in got_params]
    worst = max(diffs) if diffs else float("nan")
    equal = len(got_losses) == steps and not missing and worst <= 1e-5
    return {**rec, "outcome": "equal" if equal else "differs", "max_abs_diff": worst, "missing": missing[:5]}


def simulate(name: str, microbatches: int) -> dict:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from test_pipeline_lowering import check_against_eager, eager as eager_step

    model, batch, loss_fn = getattr(hf_pp_models, name)(B, T)
    expected = eager_step(model, batch, loss_fn)
    try:
        progs = compile_model(model, batch, loss_fn, 2, None,
                              pipeline=PipelineOptions(stages=2, microbatches=microbatches))
        check_against_eager(progs, batch, expected)
    except Exception as e:  # noqa: BLE001 - recorded
        return {"outcome": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
    return {"outcome": "equal"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(hf_pp_models.MODELS))
    ap.add_argument("--modes", default="pp,pp2dp2")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--simulate", action="store_true", help="one-process simulation on 2 stages instead of train")
    ap.add_argument("--json", default=None, help="append each record to this JSON-lines file")
    args = ap.parse_args()
    n_equal = n_all = 0
    for name in args.models.split(","):
        for mode in (["sim"] if args.simulate else args.modes.split(",")):
            t0 = time.monotonic()
            if args.simulate:
                rec = simulate(name, args.microbatches)
            else:
                with tempfile.TemporaryDirectory() as d:
                    rec = train(name, mode, args.microbatches, args.steps, Path(d) / "run", args.timeout_s)
            rec = {"model": name, "mode": mode, "microbatches": args.microbatches, **rec,
                   "wall_s": rec.get("wall_s", round(time.monotonic() - t0, 1))}
            n_all += 1
            n_equal += rec["outcome"] == "equal"
            print(json.dumps(rec), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    print(f"{n_equal} of {n_all} combinations equal eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
