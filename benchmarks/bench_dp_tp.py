"""adaptdist's ``dp,tp`` plan vs torch's own 2-D composition (DTensor TP x data parallel), in one run.

Same model (built-in GPT, default GPTConfig), same global batch, same number of
ranks (gloo on CPU, 2 x 2 mesh = 4 ranks by default), same threads per rank, same
optimizer (AdamW, lr 1e-3, weight_decay 0, i.e. adaptdist's ``make_optimizer("adamw")``),
same data (the factory's example batch, repeated). On both sides the global batch is
split on the ``dp`` axis (each ``dp`` coordinate takes its ``torch.chunk``) and
replicated along ``tp``.

- adaptdist: ``compile_model(..., ManualPlan.parse("dp,tp", adaptdist.models.gpt),
  mesh="dp=2,tp=2")``: the model file's ``TP_PLAN`` on the ``tp`` axis (column-parallel
  ``attn.q``/``k``/``v`` by heads and ``fc``, row-parallel ``attn.proj`` and ``fc_out``; since
  commit ed6e53a also ``tok_emb.weight`` by vocabulary, so the tied head gives vocabulary-sharded
  logits for a vocabulary-parallel cross entropy), parameters replicated on ``dp``, gradients
  all-reduced over ``dp`` in buckets (``--bucket-mb``). Rank processes as
  ``bench_dp.adaptdist_worker`` (``register_mesh_groups`` builds torch's DeviceMesh and registers
  its ``dp``/``tp`` groups).
- torch: ``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``;
  ``parallelize_module`` on ``mesh["tp"]`` exactly as ``bench_tp.py`` (``apply_megatron_tp``:
  Colwise q/k/v/fc, Rowwise proj/fc_out, attention forward on the local heads, and, when the plan
  shards ``tok_emb.weight``, torch's vocabulary parallelism with ``loss_parallel``; the DTensor-sharded
  parameters are checked to be exactly adaptdist's); then data parallel over ``mesh["dp"]``, one
  torch side per name in ``--torch-dp`` (all measured in the same run, alternating):

  - ``replicate`` (default): ``torch.distributed._composable.replicate_with_fsdp.replicate`` (the
    FSDP2-family ``replicate()``) on each block, then on the root, ``mesh=mesh["dp"]``: parameters
    stay replicated over ``dp``, gradients all-reduced per block group.
  - ``ddp``: torch's DDP + TP recipe, ``tensor.parallel.ddp._pre_dp_module_transform(model)`` then
    ``DistributedDataParallel(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=--bucket-mb)``.
    Refused when the plan has the tied vocabulary-parallel embedding/head (the hooks localize only
    one name of a tied parameter; DDP's first broadcast then fails).
  - ``fully_shard``: FSDP2 on ``mesh["dp"]`` per block then root (2-D FSDP x TP: it also shards
    parameters, gradients and optimizer state over ``dp``; not adaptdist's ``dp,tp`` memory layout,
    for reference only).

  Not used: ``torch.distributed._composable.replicate(model, device_mesh=mesh["dp"])`` (the
  DDP-based composable replicate). With TP parameters it trains them not at all in torch 2.13: its
  forward hooks swap the DTensor parameters for new local ones after the first forward, so the
  optimizer's parameters never receive a gradient (every DTensor parameter's ``.grad`` stays None;
  the loss still falls through the replicated parameters). See benchmarks/RESULTS.md.

Timing and memory as ``bench_dp.py`` / ``bench_fsdp.py`` / ``bench_tp.py`` (whose helpers and
workers this file imports): alternating repetitions of fresh ``launch_local`` jobs, warm-up
excluded, per step the slowest rank's time, median over all measured steps, spread of
per-repetition medians, tokens/s ratio, ``PeakMemory`` over one extra untimed step (DTensors
counted by their local shard) with the process's max RSS beside it, for every rank.

4 ranks on a 2-core machine are oversubscribed (2 single-threaded ranks per core) on both
sides alike; the figures are a comparison, not a scaling result.

    .venv/bin/python benchmarks/bench_dp_tp.py [--mesh dp=2,tp=2] [--batch-size 16] [--seq-len 128]
        [--steps 15] [--warmup 3] [--reps 4] [--threads-per-rank 1] [--bucket-mb 25]
        [--torch-dp replicate[,ddp][,fully_shard]] [--timeout-s 120] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_dp import _load_batch, _setup, _summarize, add_common_args, measure_torch_side  # noqa: E402
from bench_fsdp import (MIB, comparison_table, compile_and_save, dtensor_aware_peak_memory,  # noqa: E402
                        print_load, print_loss_check, run_alternating, write_json)
from bench_tp import apply_megatron_tp, scalar  # noqa: E402


# --------------------------------------------------------------------------- workers (one per rank)

def dtensor_dp_tp_worker(cfg: dict, torch_dp: str = "replicate") -> dict:
    """One rank of torch's 2-D composition: DTensor TP on mesh["tp"], then ``torch_dp`` (replicate, ddp or
    fully_shard) on mesh["dp"]; this dp coordinate's torch.chunk of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from adaptdist.models.gpt import factory
    from adaptdist.runtime.worker import make_optimizer

    rank, world = _setup(cfg)
    try:
        dtensor_aware_peak_memory()
        torch.manual_seed(cfg["seed"])
        model, _, loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
        names, sizes = zip(*cfg["mesh"])
        if names != ("dp", "tp") or sizes[0] * sizes[1] != world:
            raise RuntimeError(f"mesh {cfg['mesh']} must be dp=A,tp=B with A*B = {world} ranks")
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        loss_ctx = apply_megatron_tp(model, mesh["tp"], False, cfg["adaptdist_sharded"])
        if torch_dp == "replicate":  # FSDP2-family replicate(): per block, then the root
            from torch.distributed._composable.replicate_with_fsdp import replicate

            for block in model.blocks:
                replicate(block, mesh=mesh["dp"])
            replicate(model, mesh=mesh["dp"])
        elif torch_dp == "ddp":  # torch's DDP + TP recipe: localize DTensor params, then DDP on the dp group
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            from torch.nn.parallel import DistributedDataParallel as DDP

            if "tok_emb.weight" in cfg["adaptdist_sharded"]:
                # _localize_dtensor walks named_parameters(), which lists the tied weight once: head.weight stays
                # a DTensor beside the localized tok_emb.weight and DDP's first broadcast fails ("aten.cat.default
                # got mixed torch.Tensor and DTensor")
                raise RuntimeError("--torch-dp ddp: torch's DDP + TP hooks do not handle the tied vocabulary-parallel "
                                   "embedding/head of this plan; use --torch-dp replicate")
            _pre_dp_module_transform(model)
            model = DDP(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=cfg["bucket_mb"])
        elif torch_dp == "fully_shard":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        else:
            raise RuntimeError(f"unknown --torch-dp {torch_dp!r}")
        opt = make_optimizer("adamw", list(model.parameters()), cfg["lr"])
        batch = _load_batch(cfg)
        dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()

        def step(global_batch):
            x, y = (torch.chunk(t, dp_size)[dp_rank] for t in global_batch)
            opt.zero_grad(set_to_none=True)
            with loss_ctx():
                loss = loss_fn(model(x), y)
                loss.backward()
            opt.step()
            return scalar(loss)  # this dp shard's loss; the parent averages over ranks (equal chunks)

        # the optimizer's parameters, not model.parameters(): after DDP's TP hooks (_reconstruct_dtensor /
        # _localize_dtensor) the module holds the TP-sharded weights as plain DTensor attributes, which
        # model.parameters() no longer lists (their local leaves live on in the optimizer)
        params = [p for g in opt.param_groups for p in g["params"]]
        return measure_torch_side(step, batch, cfg, params, model, opt)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent

def rep_medians(reps: list[dict], warmup: int) -> list[float]:
    """Per repetition: the median over measured steps of the slowest rank's step time (s)."""
    out = []
    for res in reps:
        n = len(res[0]["times"])
        out.append(statistics.median(max(res[r]["times"][i] for r in res) for i in range(warmup, n)))
    return out


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="dp=2,tp=2", help="the 2-D mesh, dp axis first (gloo, CPU)")
    add_common_args(ap, steps=15, batch_help="global batch size (split over dp)",
                    bucket_help="gradient bucket size, MiB: adaptdist's, and replicate's bucket_cap_mb (its default is 25)")
    ap.add_argument("--torch-dp", default="replicate",
                    help="torch's data parallelism over mesh['dp'], comma-separated, each one side of the same run: "
                         "replicate, ddp, fully_shard (see the module docstring)")
    args = ap.parse_args(argv)
    from adaptdist.mesh import Mesh

    args.mesh_axes = Mesh.parse(args.mesh).axes
    args.nproc = Mesh.parse(args.mesh).world_size
    return args


def main(argv=None) -> int:
    from bench_dp import example_batch, prelude

    from adaptdist.annotations import ManualPlan
    from adaptdist.models import gpt
    from adaptdist.placement import Shard

    args = _parse(argv)
    con, tokens = prelude(args, f", split over dp and replicated over tp (mesh {args.mesh})")
    torch_dps = [t.strip() for t in args.torch_dp.split(",") if t.strip()]
    unknown = set(torch_dps) - {"replicate", "ddp", "fully_shard"}
    if unknown or not torch_dps:
        raise SystemExit(f"--torch-dp {args.torch_dp!r}: use replicate, ddp and/or fully_shard")
    torch_names = {t: f"TP x {t}" for t in torch_dps}

    with tempfile.TemporaryDirectory(prefix="bench_dp_tp-") as tmp:
        model, example, _, n_params, batch_file = example_batch(args, tmp)
        secs = compile_and_save("dp,tp", args.nproc, args.batch_size, args.seq_len, args.seed,
                                Path(tmp) / "programs", int(args.bucket_mb * MIB), mesh=args.mesh)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        tp_pl = ManualPlan.parse("dp,tp", gpt).axis_placements(shapes)["tp"]
        adaptdist_sharded = sorted(n for n, pl in tp_pl.items() if isinstance(pl, Shard))
        if "ddp" in torch_dps and "tok_emb.weight" in adaptdist_sharded:
            raise SystemExit("--torch-dp ddp: torch's DDP + TP hooks do not handle the tied vocabulary-parallel "
                             "embedding/head of this plan (see dtensor_dp_tp_worker); use --torch-dp replicate")
        con.print(f"{n_params / 1e6:.2f} M parameters; compiled adaptdist plan 'dp,tp' on mesh {args.mesh} "
                  f"({args.nproc} ranks) in {secs:.1f} s (not part of the timings); sharded over tp on both sides: "
                  f"{len(adaptdist_sharded)} tensors ({', '.join(n for n in adaptdist_sharded if n.startswith('blocks.0.'))}, "
                  f"same in every block); torch sides: DTensor TP x {', '.join(torch_dps)} on mesh['dp']")
        cfg = {"program_dir": str(Path(tmp) / "programs"), "batch_file": batch_file, "lr": args.lr,
               "seed": args.seed, "threads": args.threads_per_rank, "timeout_s": args.timeout_s,
               "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "mesh": [list(a) for a in args.mesh_axes], "bucket_mb": args.bucket_mb,
               "adaptdist_sharded": adaptdist_sharded}
        import bench_dp
        import bench_dp_tp  # this file as an importable module, so spawn can unpickle the workers

        sides = {"adaptdist": bench_dp.adaptdist_worker}
        for t, name in torch_names.items():
            # update_wrapper: the elastic launcher names the job after fn.__name__
            sides[name] = functools.update_wrapper(functools.partial(bench_dp_tp.dtensor_dp_tp_worker, torch_dp=t),
                                                   bench_dp_tp.dtensor_dp_tp_worker)
        results, load_before, load_after, wall = run_alternating(con, sides, cfg, args)
        print_load(con, load_before, load_after, wall, args)
        if args.json:
            write_json(args.json, args, load_before, load_after, results)

    a = _summarize(results["adaptdist"], args.warmup, tokens)
    summary = []
    for t, name in torch_names.items():
        d = _summarize(results[name], args.warmup, tokens)
        ratio = comparison_table(con, f"adaptdist dp,tp plan vs torch DTensor {name} — mesh {args.mesh}, "
                                      f"{args.threads_per_rank} thread(s) per rank, global batch "
                                      f"{args.batch_size}x{args.seq_len}", name, a, d)
        print_loss_check(con, {"adaptdist": results["adaptdist"], name: results[name]})
        last_ok = abs(a["last_loss"] - d["last_loss"]) <= 1e-3 * abs(d["last_loss"])
        con.print(f"last-step loss (last rep): adaptdist {a['last_loss']:.6f}, {name} {d['last_loss']:.6f} -> "
                  f"[bold]{'AGREE' if last_ok else 'DIFFER: the two sides do not train the same model'}[/] "
                  f"(tolerance 1e-3 relative)")
        paired = statistics.median(t_ / a_ for a_, t_ in zip(rep_medians(results["adaptdist"], args.warmup),
                                                            rep_medians(results[name], args.warmup)))
        summary.append(f"vs {name}: throughput {ratio:.3f}x (all-steps median), "
                       f"{d['min_rep_s'] / a['min_rep_s']:.3f}x (fastest per-rep medians), {paired:.3f}x (median over "
                       f"reps of the same rep's ratio); peak live tensors per rank "
                       + "/".join(f"{a['peak_bytes'][r] / d['peak_bytes'][r]:.3f}" for r in sorted(a["peak_bytes"]))
                       + f" (ranks {', '.join(map(str, sorted(a['peak_bytes'])))}); losses "
                       + ("agree" if last_ok else "DIFFER"))
    con.print(f"measured steps per side: {a['n_steps']} (per step: slowest rank); memory from one extra step "
              f"of the last rep inside PeakMemory (DTensors counted by their local shard); "
              f"RSS = the rank process's lifetime max.")
    con.print("[bold]ratios, adaptdist dp,tp / torch[/]:")
    for line in summary:
        con.print("  " + line)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_dp_tp

    sys.exit(bench_dp_tp.main())
