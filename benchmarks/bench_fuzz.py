"""The long fuzz run (issue 18): the generators of ``tests/fuzz_inputs.py`` -- cluster files, manual plan files,
plan.json, edited program directories, CLI argument sets -- with many more examples than CI's short run,
random (not derandomized) from ``--seed``. Prints, per kind, the cases, the clean errors (adaptdist's own error
naming the file, or argparse's exit 2), the accepted inputs, the failures (another exception, over the time
bound, over the memory bound), the slowest case and the largest peak of Python memory; failures are printed in
full (the first ``--show`` of each kind). Exit code 1 when any case failed.

    .venv/bin/python benchmarks/bench_fuzz.py [--examples 2000] [--seed 0] [--kinds cluster,plan_yaml,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

KINDS = ("cluster", "plan_yaml", "plan_json", "artifacts", "cli")


def _program_dirs(root: Path) -> tuple[Path, Path]:
    """As tests/test_fuzz_inputs.py's fixture: two saved 2-rank compiles of the MLP (dp, fsdp)."""
    from models import mlp
    from safetensors.torch import save as save_tensors

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import save_programs

    out = []
    for name in ("dp", "fsdp"):
        model, batch, loss = mlp(batch_size=8)
        programs = compile_model(model, batch, loss, 2, ManualPlan.parse(name))
        out.append(save_programs(programs, root / name, extra_files={
            "example_batch.safetensors": save_tensors({f"b{i}": x.contiguous() for i, x in enumerate(batch)})}))
    return out[0], out[1]


def run_kind(kind: str, examples: int, seed: int, work: Path) -> "fz.Tally":  # noqa: F821
    import fuzz_inputs as fz
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    tally = fz.Tally()
    d = work / kind
    d.mkdir()
    names_of = {"cluster": [str(d / "cluster.yaml")], "plan_yaml": [str(d / "plan.yaml"), "'plan.yaml'"],
                "plan_json": [str(d / "plan.json")], "artifacts": [str(d / "programs")], "cli": ["--"]}
    if kind == "artifacts":
        pristine, other = _program_dirs(work / "compiled")
        manifest = json.loads((pristine / "manifest.json").read_text())
        meta = json.loads((pristine / "rank0" / "program.json").read_text())
        strategy, make = fz.artifact_edits(manifest, meta), (lambda e: fz.artifact_case(e, pristine, other, d))
    else:
        strategy = {"cluster": fz.cluster_texts, "plan_yaml": fz.plan_yaml_texts, "plan_json": fz.plan_json_texts,
                    "cli": fz.cli_argvs}[kind]()
        make = {"cluster": fz.cluster_case, "plan_yaml": fz.plan_yaml_case, "plan_json": fz.plan_json_case,
                "cli": fz.cli_case}[kind]
        make = (lambda f: (lambda x: f(x, d)))(make)

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(x=strategy)
    def run(x):
        fz.run_case(make(x), names_of[kind], tally)  # tallied, not asserted: the run goes on past a failure

    run()
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="hypothesis examples per kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--show", type=int, default=3, help="failures printed per kind")
    args = ap.parse_args(argv)
    import fuzz_inputs as fz
    import torch

    print(f"bench_fuzz: {args.examples} examples per kind, seed {args.seed}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; bounds {fz.TIME_LIMIT_S:g} s and "
          f"{fz.MEMORY_LIMIT_BYTES / 2**20:.0f} MiB per case")
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            t0 = time.perf_counter()
            tally = run_kind(kind, args.examples, args.seed, Path(tmp))
            rows.append(tally.row(kind) + f" {time.perf_counter() - t0:.0f} |")
            failed += len(tally.failures)
            for f in tally.failures[:args.show]:
                print(f"--- {kind} failure:\n{f}\n")
    print("| kind | cases | clean errors | accepted | failures | slowest case (s) | peak memory (MiB) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    import resource

    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB (torch and the "
          f"compiled programs included); load {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
