"""Compile time of ``adaptdist compile``, phase by phase: capture, planning, lowering, codegen (plus the
cost-model estimate for the report, and writing the artifacts).

Models: the built-in GPT (``builtin:gpt``: 4 layers, 192 wide, 1.85 M parameters) and a Hugging Face
GPT-2-small-shaped model built from its config (``transformers.GPT2Config()``: 12 layers, 768 wide,
124 M parameters, random weights, no download; eager attention and an explicit attention mask,
because transformers' sdpa mask path has data-dependent checks our capture cannot trace; its
padding-mask lookup, ``aten.index.Tensor``, has no sharding rule and runs replicated, as
``--replicate-fallback`` does). Clusters: 2 local CPU ranks (``local_cluster(2)``) and one host of
8 GPUs (a cluster file with A100-like figures; compile only, nothing runs on them). Plans: the
automatic planner (``--plan auto``) and the manual ``dp`` preset beside it. Every configuration is
compiled ``--repeats`` times in this process (the first includes one-time imports and torch's
warm-up; the median is printed).

    .venv/bin/pip install -e ".[bench]"   # transformers, for the GPT-2 model
    .venv/bin/python benchmarks/bench_compile.py [--repeats 2] [--models gpt,gpt2] [--clusters cpu2,gpu8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HF_FACTORY = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel


    class LM(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(cfg)

        def forward(self, input_ids, attention_mask):
            return self.gpt2(input_ids=input_ids, attention_mask=attention_mask).logits


    def factory(batch_size, seq_len):
        torch.manual_seed(0)
        cfg = GPT2Config(n_positions=max(seq_len, 128), use_cache=False, attn_implementation="eager")
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        return LM(cfg), (x, mask, x.clone()), lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
''')

GPU8 = textwrap.dedent('''
    schema_version: 2
    hosts:
      - name: gpu-host
        devices:
    {devices}
    links:
      - {{tier: intra_host, bandwidth_bytes_per_s: 4.5e11, latency_s: 5.0e-6}}
    calibration: null
''')


def _gpu8_file(tmp: Path) -> Path:
    dev = ("      - {{rank: {r}, kind: cuda, peak_flops: {{float32: 1.95e13, bfloat16: 3.12e14}}, "
           "memory_bytes: 80000000000, memory_bandwidth_bytes_per_s: 2.0e12}}")
    text = GPU8.format(devices="\n".join("    " + dev.format(r=r) for r in range(8)))
    p = tmp / "gpu8.yaml"
    p.write_text(text)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="gpt,gpt2")
    ap.add_argument("--clusters", default="cpu2,gpu8")
    ap.add_argument("--plans", default="auto,dp")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    from rich.console import Console
    from rich.table import Table

    from adaptdist.calibrate.local import load_cluster, local_cluster
    from adaptdist.compiler.artifacts import compile_artifacts
    from adaptdist.model_spec import ModelSpec

    console = Console(width=160)
    tmp = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    (tmp / "hf_gpt2.py").write_text(HF_FACTORY)
    models = {"gpt": ("builtin:gpt", 16, 128), "gpt2": (f"{tmp / 'hf_gpt2.py'}:factory", 8, 128)}
    clusters = {"cpu2": lambda: local_cluster(2), "gpu8": lambda: load_cluster(_gpu8_file(tmp))}
    phases = ("capture", "planning", "lowering", "codegen", "estimate", "writing")
    table = Table(title=f"adaptdist compile time per phase, seconds (median of {args.repeats}; {time.strftime('%Y-%m-%d')})")
    for col in ("model", "cluster", "plan", *phases, "total", "mesh"):
        table.add_column(col)
    for m in args.models.split(","):
        text, B, T = models[m]
        for c in args.clusters.split(","):
            for plan in args.plans.split(","):
                runs = []
                mesh = ""
                for i in range(args.repeats):
                    res = compile_artifacts(ModelSpec.parse(text), clusters[c](), batch_size=B, seq_len=T, plan_arg=plan,
                                            out_dir=tmp / f"{m}_{c}_{plan}_{i}", replicate_fallback=(m == "gpt2"))
                    runs.append(res.phases_s)
                    mesh = ",".join(f"{a}={n}" for a, n in res.plan.mesh.items())
                med = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in phases}
                table.add_row(m, c, plan, *(f"{med[p]:.2f}" for p in phases), f"{sum(med.values()):.2f}", mesh)
                console.print(f"{m} on {c}, plan {plan}: " + ", ".join(f"{p} {med[p]:.2f} s" for p in phases))
    console.print(table)
    console.print(f"batch: gpt 16 x 128 tokens, gpt2 8 x 128 tokens; artifacts under {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
