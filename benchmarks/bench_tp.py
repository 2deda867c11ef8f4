"""adaptdist's ``tp`` plan vs torch DTensor tensor parallelism, measured in one run.

Same model (built-in GPT, default GPTConfig), same global batch, same number of
ranks (gloo on CPU), same threads per rank, same optimizer (AdamW, lr 1e-3,
weight_decay 0, i.e. adaptdist's ``make_optimizer("adamw")``), same data (the
factory's example batch, repeated). The batch is replicated on both sides: every
rank feeds the whole global batch.

- adaptdist: ``ManualPlan.parse("tp", adaptdist.models.gpt)``, the model file's
  ``TP_PLAN`` (since commit 8ec7852: column-parallel ``attn.q``/``k``/``v`` (sharded by
  heads) and ``fc``; row-parallel ``attn.proj`` and ``fc_out``, their biases replicated;
  embeddings, layer norms replicated; since commit ed6e53a also ``tok_emb.weight`` by vocabulary,
  the tied head then yields vocabulary-sharded logits for a vocabulary-parallel cross entropy).
  With ``--mlp-only``, a plan file sharding only ``blocks.*.fc`` (S(0)) and
  ``blocks.*.fc_out.weight`` (S(1)).
- DTensor: ``parallelize_module`` on ``init_device_mesh("cpu", (world,))`` with
  ``ColwiseParallel()`` on each ``blocks.{i}.attn.{q,k,v}`` and ``blocks.{i}.fc``,
  ``RowwiseParallel()`` on each ``blocks.{i}.attn.proj`` and ``blocks.{i}.fc_out``
  (``--mlp-only``: ``fc`` and ``fc_out`` only); when the plan shards ``tok_emb.weight``, torch's
  vocabulary parallelism as well (``RowwiseParallel(input_layouts=Replicate())`` on ``tok_emb``,
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` on the tied ``head``, the
  loss and backward under ``loss_parallel()``); everything else replicated, plain tensors.
  As in torch's TP tutorial, the attention then works on this rank's heads: its forward is
  replaced, in the rank process only, by the same computation with ``-1`` for the local
  number of heads in ``view``/``reshape`` (the model's ``reshape(B, T, C)`` assumes all heads;
  DTensor has no sharding rule for CPU flash attention, so it cannot stay a DTensor). The
  worker checks that the DTensor-sharded parameters are exactly those adaptdist's plan shards.

Timing and memory follow ``bench_dp.py`` / ``bench_fsdp.py`` (whose helpers this file
imports): alternating repetitions of fresh ``launch_local`` jobs, warm-up excluded,
per step the slowest rank's time, median over all measured steps, spread of
per-repetition medians, tokens/s ratio, and ``PeakMemory`` over one extra untimed step
(DTensors counted by their local shard) with the process's max RSS beside it.

    .venv/bin/python benchmarks/bench_tp.py [--nproc 2] [--batch-size 16] [--seq-len 128]
        [--steps 20] [--warmup 3] [--reps 4] [--threads-per-rank 1] [--timeout-s 120] [--mlp-only]
"""

from __future__ import annotations

import argparse
import types
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_dp import _load_batch, _setup, _summarize, add_common_args, measure_torch_side  # noqa: E402
from bench_fsdp import (MIB, comparison_table, compile_and_save, dtensor_aware_peak_memory,  # noqa: E402
                        print_load, print_loss_check, run_alternating, write_json)


# --------------------------------------------------------------------------- workers (one per rank)

def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` on this rank's heads (q/k/v column-parallel, proj row-parallel)."""
    import torch.nn.functional as F

    B, T, C = x.shape
    hd = C // self.num_heads
    q, k, v = (p(x).view(B, T, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H / world, T, hd]
    return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def apply_megatron_tp(model, tp_mesh, mlp_only: bool, expect_sharded: list[str]):
    """``parallelize_module`` on the 1-D ``tp_mesh``: Colwise q/k/v and fc, Rowwise proj and fc_out
    (``mlp_only``: fc/fc_out only), attention forward on the local heads; when adaptdist's plan shards
    ``tok_emb.weight`` (vocabulary-parallel embedding, since commit ed6e53a), also torch's vocabulary
    parallelism: ``RowwiseParallel(input_layouts=Replicate())`` on ``tok_emb``, ``ColwiseParallel(
    output_layouts=Shard(-1), use_local_output=False)`` on the tied ``head`` (re-tied to the embedding's
    DTensor afterwards) and the loss under ``loss_parallel()``. Raises RuntimeError unless the
    DTensor-sharded parameters are exactly ``expect_sharded`` (adaptdist's plan's).

    Returns a context-manager factory to wrap each step's loss and backward in (``loss_parallel`` or a
    no-op). Shared with bench_dp_tp."""
    import contextlib

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    plan = {}
    for i, block in enumerate(model.blocks):
        plan[f"blocks.{i}.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.fc_out"] = RowwiseParallel()
        if not mlp_only:
            for n in ("q", "k", "v"):
                plan[f"blocks.{i}.attn.{n}"] = ColwiseParallel()
            plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
            block.attn.forward = types.MethodType(_local_heads_forward, block.attn)
    vocab = "tok_emb.weight" in expect_sharded
    if vocab:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    if vocab:
        model.head.weight = model.tok_emb.weight  # parallelize_module made two Parameters of the tied one
    sharded = sorted(n for n, p in model.named_parameters()
                     if hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements))
    if sharded != expect_sharded:
        raise RuntimeError(f"DTensor shards {sharded}, adaptdist's plan shards {expect_sharded}")
    return loss_parallel if vocab else contextlib.nullcontext


def scalar(loss) -> float:
    """A loss as a float (a DTensor loss from ``loss_parallel`` is replicated)."""
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def build_dtensor_tp(cfg: dict, rank: int, world: int):
    """DTensor TP's step (:func:`dtensor_tp_worker`): ``(step, model, opt)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from adaptdist.models.gpt import factory
    from adaptdist.runtime.worker import make_optimizer

    torch.manual_seed(cfg["seed"])
    model, _, loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
    mesh = init_device_mesh("cpu", (world,))
    loss_ctx = apply_megatron_tp(model, mesh, cfg["mlp_only"], cfg["adaptdist_sharded"])
    opt = make_optimizer("adamw", list(model.parameters()), cfg["lr"])

    def step(global_batch):
        x, y = global_batch
        opt.zero_grad(set_to_none=True)
        with loss_ctx():
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        return scalar(loss)  # the same global loss on every rank

    return step, model, opt


def dtensor_tp_step(cfg: dict, rank: int, world: int):
    """The DTensor side's step (an ``interleave`` builder)."""
    return build_dtensor_tp(cfg, rank, world)[0]


def dtensor_tp_worker(cfg: dict) -> dict:
    """One rank of DTensor TP: same model and seed, Colwise fc / Rowwise fc_out, whole batch on every rank."""
    rank, world = _setup(cfg)
    try:
        dtensor_aware_peak_memory()
        step, model, opt = build_dtensor_tp(cfg, rank, world)
        batch = _load_batch(cfg)
        return measure_torch_side(step, batch, cfg, model.parameters(), model, opt)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent

def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (gloo, CPU)")
    add_common_args(ap, steps=20, batch_help="global batch size (every rank feeds all of it)",
                    bucket_help="adaptdist's gradient bucket size, MiB")
    ap.add_argument("--mlp-only", action="store_true",
                    help="shard only blocks.*.fc / fc_out on both sides (adaptdist: a plan file) instead of TP_PLAN")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from bench_dp import example_batch, prelude

    args = _parse(argv)
    con, tokens = prelude(args, ", [bold]replicated[/] (every rank feeds all of it)")

    with tempfile.TemporaryDirectory(prefix="bench_tp-") as tmp:
        model, example, _, n_params, batch_file = example_batch(args, tmp)
        plan_text = "tp"
        if args.mlp_only:
            plan_text = str(Path(tmp) / "mlp_only.yaml")
            Path(plan_text).write_text("schema_version: 1\nmesh_axis: tp\nshard_batch: false\nparams:\n"
                                       "  blocks.*.fc.weight: S(0)\n  blocks.*.fc.bias: S(0)\n"
                                       "  blocks.*.fc_out.weight: S(1)\n")
        from bench_dp import adaptdist_sides, compile_comms, sides_table

        t0 = time.perf_counter()
        program_dirs = compile_comms(args.comm, lambda c: str(Path(tmp) / f"programs_{c}") if compile_and_save(
            plan_text, args.nproc, args.batch_size, args.seq_len, args.seed, Path(tmp) / f"programs_{c}",
            int(args.bucket_mb * MIB), comm=c) is not None else "")
        secs = time.perf_counter() - t0
        from adaptdist.annotations import ManualPlan
        from adaptdist.models import gpt

        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        adaptdist_sharded = sorted(ManualPlan.parse(plan_text, gpt).placements(shapes))
        con.print(f"{n_params / 1e6:.2f} M parameters; compiled adaptdist plan "
                  f"{'fc/fc_out only (--mlp-only)' if args.mlp_only else repr('tp') + ' (TP_PLAN of adaptdist.models.gpt)'} "
                  f"for {args.nproc} ranks in {secs:.1f} s (not part of the timings); sharded on both sides: "
                  f"{len(adaptdist_sharded)} tensors ({', '.join(n for n in adaptdist_sharded if n.startswith('blocks.0.'))}, "
                  f"same in every block)")
        cfg = {"program_dirs": program_dirs, "batch_file": batch_file, "lr": args.lr,
               "seed": args.seed, "threads": args.threads_per_rank, "timeout_s": args.timeout_s,
               "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "mlp_only": args.mlp_only, "adaptdist_sharded": adaptdist_sharded}
        import bench_dp
        import bench_tp  # this file as an importable module, so spawn can unpickle the workers

        if args.interleave:
            from interleave import adaptdist_builders, report, run_interleaved

            results, load_before, load_after, wall = run_interleaved(
                con, {**adaptdist_builders(program_dirs), "DTensor": "bench_tp:dtensor_tp_step"}, cfg, args.nproc,
                args.reps)
            print_load(con, load_before, load_after, wall, args)
            report(con, results, args, tokens, "DTensor", _summarize, sides_table)
            if args.json:
                write_json(args.json, args, load_before, load_after, results)
            return 0
        sides = {**adaptdist_sides(program_dirs), "DTensor": bench_tp.dtensor_tp_worker}
        results, load_before, load_after, wall = run_alternating(con, sides, cfg, args)
        print_load(con, load_before, load_after, wall, args)
        if args.json:
            write_json(args.json, args, load_before, load_after, results)

    summaries = {side: _summarize(res, args.warmup, tokens) for side, res in results.items()}
    sides_table(con, f"all sides (load average before/after: {load_before[0]:.1f}/{load_after[0]:.1f})",
                summaries, "DTensor")
    a, d = summaries[next(iter(summaries))], summaries["DTensor"]
    ratio = comparison_table(con, f"adaptdist tp plan vs torch DTensor TP — {args.nproc} ranks x "
                                  f"{args.threads_per_rank} thread(s), global batch {args.batch_size}x{args.seq_len} "
                                  f"replicated{', MLP only' if args.mlp_only else ''}", "DTensor", a, d)
    con.print(f"measured steps per side: {a['n_steps']} (per step: slowest rank); memory from one extra step "
              f"of the last rep inside PeakMemory (DTensors counted by their local shard); "
              f"RSS = the rank process's lifetime max.")
    print_loss_check(con, results)
    con.print(f"target adaptdist >= 0.9x DTensor TP throughput: [bold]{'MET' if ratio >= 0.9 else 'NOT MET'}[/] "
              f"({ratio:.3f}x on the all-steps median; {d['min_rep_s'] / a['min_rep_s']:.3f}x on the fastest "
              f"per-rep medians)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_tp

    sys.exit(bench_tp.main())
