"""Where the inter-stage planner predicts a pipeline to beat data parallelism (issue 15, point 7, planner side).

For wide MLPs (``--depth`` Linear(width, width) + ReLU, MSE loss; models on meta tensors, nothing runs) of
several widths and batches, and the built-in GPT, on ``--nproc`` ranks of this machine's cluster (``--cluster
FILE`` from ``adaptdist cluster profile``, else the estimated local one), prints the predicted step of

- ``ddp``: data parallelism over every rank in the pipeline planner's cost model (the whole step split over the
  batch, a ring all_reduce of every gradient: what ``--plan dp`` runs);
- ``dp-mesh``: the SPMD planner on the fixed mesh ``dp=N`` (its ILP may keep some layers whole);
- ``auto``: the SPMD planner's best mesh (``plan_auto``);
- ``pp``: the inter-stage planner's pipeline (``plan_pipeline(..., uniform=True)``, what the pipeline lowering
  runs), its stages, schedule and microbatches;

and which one ``run_planner(..., pipeline=True)`` would take. The planner times are printed too. Outside CI:
``python benchmarks/bench_pp_planner.py [--nproc 2] [--cluster FILE]``.
"""

from __future__ import annotations

import argparse
import itertools
import time


def wide_mlp(width: int, depth: int, batch: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from adaptdist.compiler.capture import capture

    with torch.device("meta"):
        model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(width, width), nn.ReLU())
                                                             for _ in range(depth)))
    x = torch.zeros(batch, width, device="meta")
    return capture(model, (x, x), F.mse_loss)


def gpt(layers: int, batch: int, seq: int):
    import torch

    from adaptdist.compiler.capture import capture
    from adaptdist.models.gpt import GPT, GPTConfig, lm_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(dim=192, num_layers=layers, num_heads=4, max_seq_len=seq))
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return capture(model, (x, x), lm_loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cluster", default=None, help="a cluster file (adaptdist cluster profile)")
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()

    from adaptdist.calibrate.local import load_cluster, local_cluster
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.compiler.planner.layers import build_layers
    from adaptdist.compiler.planner.stages import StageCoster, plan_pipeline
    from adaptdist.mesh import Mesh

    cluster = load_cluster(args.cluster) if args.cluster else local_cluster(args.nproc)
    n = cluster.world_size
    print(f"cluster: {cluster!r}")
    cases = [(f"mlp w={w} b={b}", lambda w=w, b=b: wide_mlp(w, args.depth, b))
             for w, b in ((4096, 8), (2048, 16), (2048, 64), (1024, 64), (256, 512))]
    cases.append(("gpt 4 layers 8x128", lambda: gpt(4, 8, 128)))
    print(f"{'case':22} {'ddp ms':>9} {'dp-mesh':>9} {'auto':>14} {'pp ms':>9}  pipeline (s planner)  -> taken")
    for name, build in cases:
        cg = build()
        t0 = time.perf_counter()
        auto = plan_auto(cg, cluster)
        dpm = plan_auto(cg, cluster, mesh=Mesh.parse(f"dp={n}"))
        t1 = time.perf_counter()
        lg = build_layers(auto.graph)
        e = StageCoster(lg, cluster, mode="analytic")(0, len(lg.layers), tuple(range(n)))
        ddp = e.compute_s + e.overhead_s + e.grad_sync_s
        try:
            ch = plan_pipeline(cg, cluster, spmd_step_s=auto.predicted.step_s, pg=auto.graph, uniform=True)
            pp, what = ch.step_s, (f"{ch.num_stages} stages {[len(s.layers) for s in ch.stages]} "
                                   f"{ch.schedule} m={ch.microbatches}")
            taken = "pp" if ch.chosen else str(auto.candidate)
        except Exception as err:  # noqa: BLE001 -- a benchmark row says why it has no pipeline
            pp, what, taken = float("nan"), f"none: {err}", str(auto.candidate)
        t2 = time.perf_counter()
        print(f"{name:22} {1e3 * ddp:9.2f} {1e3 * dpm.predicted.step_s:9.2f} "
              f"{str(auto.candidate) + ' ' + format(1e3 * auto.predicted.step_s, '.2f'):>14} {1e3 * pp:9.2f}  "
              f"{what} ({t1 - t0:.1f}+{t2 - t1:.1f} s) -> {taken}")


if __name__ == "__main__":
    main()
