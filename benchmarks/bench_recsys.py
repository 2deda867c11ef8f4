"""builtin:dlrm, issue 17 points 3 and 5 on CPU: samples/s and validation RMSE of the asynchronous heterogeneous
mode beside the synchronous mode and one CPU process, measured side by side on this machine (ranks pinned to
cores), and the cost model's prediction for this machine and for a cluster file with CPU hosts and GPUs.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_recsys.py [--data DIR] [--epochs 2] [--batch-size 256]
        [--lr 2e-3] [--sgd-lr 0.05] [--optimizer adamw,sgd] [--staleness 0,1,4]
        [--cluster benchmarks/clusters/cpu_hosts_and_gpus.yaml] [--skip-runs]
    PYTHONPATH=. python benchmarks/bench_recsys.py --device-figures [--device cuda|cpu] [--cpu-ranks 4] [--steps 200]

``--device-figures`` (what ``benchmarks/device_check.sh`` runs on a machine with a GPU): the same batches, the
same steps, three ``adaptdist train builtin:dlrm`` runs on this machine side by side, samples/s of each and the
ratios: *GPU-only* (one rank on ``cuda``, ``--mode sync --plan dp``), *CPU-only* (``--cpu-ranks`` cpu ranks, each
pinned to its share of the cores, ``--mode sync --plan dp``) and *heterogeneous* (those cpu ranks hold the
embedding tables, the GPU rank the dense part: ``--mode async-hetero --dense-ranks N --max-staleness K``).
``--device cpu`` puts the "GPU" rank on a cpu rank (a dry run of the plumbing, not a figure).

For each optimizer of ``--optimizer`` (AdamW and SGD by default), runs, one after the other, the same epochs of
the same shuffled batches (seed 0):

- ``1 process``: eager PyTorch in this process, pinned to core 0, 1 thread;
- ``sync``: ``adaptdist train builtin:dlrm --mode sync --plan dp`` on 2 ranks pinned to cores 0 and 1;
- ``async-hetero K``: ``adaptdist train builtin:dlrm --mode async-hetero --max-staleness K`` on 2 ranks (rank 0
  sparse on core 0, rank 1 dense on core 1), for each K of ``--staleness``.

samples/s is the batch over each run's mean step (the synchronous worker's ``summary.json`` ``mean_step_time_s``:
its steps after the first 2, data loading left out; eager's likewise; the asynchronous mode's: the mean interval
between two step ends on its first dense rank after 5 steps, the pipeline's throughput, data loading included),
with the median step beside it (a queue K deep delivers steps in bursts: its median flatters it); the RMSE is on the held-out 20%
(the latest by timestamp). Beside them: the mean interval between step ends of both modes (data loading included
in both: the measure the cost model's ratio is compared with, printed last with what ``--mode auto`` picks) and
the busiest rank's CPU milliseconds per step (every thread; less sensitive to the load than the wall clock). On 2
CPU cores the dense rank is a CPU standing in for an accelerator: these figures
test the mode, not the paper's GPU claim (2.1x over GPU-only, 3.3x over CPU-only). Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def one_process(args) -> dict:
    """Eager PyTorch on the batches `adaptdist train` draws, pinned to core 0 with 1 thread."""
    from adaptdist.data import movielens as ml
    from adaptdist.models import dlrm

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model, _, loss_fn = dlrm.factory(args.batch_size, 1, data_path=args.data)
    steps = args.epochs * ml.steps_per_epoch(ml.resolve(args.data).split()[0].numel(), args.batch_size)
    batches = dlrm.data(args.batch_size, 1, path=args.data, seed=args.seed)
    opt = (torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=args.lr)
    times = []
    t_start = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        t0 = time.perf_counter()  # the step alone, as the synchronous worker times it
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    fields, _ = dlrm.evaluate(model, args.data)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {"run": "1 process (eager, core 0)", "steps": steps,
            "samples_per_s": args.batch_size / statistics.fmean(times[2:]),
            "median_samples_per_s": args.batch_size / statistics.median(times[2:]),
            "loop_samples_per_s": steps * args.batch_size / wall, "validation_rmse": fields["validation_rmse"]}


def pinned_cluster(directory: Path) -> Path:
    """This machine as 2 local cpu ranks pinned to cores 0 and 1 (`adaptdist cluster detect`'s figures)."""
    from adaptdist.calibrate.local import local_cluster
    from adaptdist.cluster import Cluster, Host
    from adaptdist.cluster_file import save_cluster
    import dataclasses

    c = local_cluster(2)
    host = c.hosts[0]
    devices = tuple(dataclasses.replace(d, cpus=(d.rank,)) for d in host.devices)
    pinned = dataclasses.replace(c, hosts=(Host(host.name, devices),))
    assert isinstance(pinned, Cluster)
    path = directory / "pinned.yaml"
    save_cluster(pinned, path)
    return path


def train(args, cluster: Path, steps: int, mode_flags: list[str], name: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "builtin:dlrm", "--cluster", str(cluster),
               "--steps", str(steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed",
               str(args.seed), "--optimizer", args.optimizer, "--checkpoint-every", "1000000", "--out", out,
               "--timeout-s", "120", *mode_flags]
        if args.data:
            cmd += ["--data", args.data]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=getattr(args, "run_timeout_s", None))
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-3000:]
            raise SystemExit(f"{' '.join(cmd)} ran past {e.timeout:.0f} s:\n"
                             f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}") from None
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
    B = args.batch_size
    return {"run": name, "steps": s["steps"], "samples_per_s": B / s["mean_step_time_s"],
            "median_samples_per_s": B / s["step_time_s"],
            "validation_rmse": s.get("validation_rmse", s.get("evaluation", {}).get("validation_rmse")),
            "command_wall_s": time.perf_counter() - t0, "mode": s.get("mode"), "roles": s.get("roles"),
            "rank_seconds": s.get("rank_seconds"),
            "interval_samples_per_s": B / s["mean_interval_s"] if s.get("mean_interval_s") else None,
            "cpu_step_s": _cpu_step_s(s)}


def _cpu_step_s(summary: dict) -> float | None:
    """The busiest rank's CPU seconds per step (every thread of the process; load-independent, unlike the wall
    clock): the synchronous worker's ``cpu_step_s`` (rank 0; dp ranks do the same work), the asynchronous ranks'
    ``cpu_s`` over the steps."""
    if summary.get("cpu_step_s") is not None:
        return summary["cpu_step_s"]
    ranks = summary.get("rank_seconds") or {}
    per = [r["cpu_s"] / summary["steps"] for r in ranks.values() if "cpu_s" in r]
    return max(per) if per else None


def local_cluster_file(path: Path, cpu_ranks: int, accelerator: str, cores: tuple[int, ...]) -> Path:
    """One host, ``localhost``: ``cpu_ranks`` cpu ranks pinned to equal shares of ``cores`` (ranks 0..n-1), then
    (``accelerator`` ``cuda`` or ``cpu``, or none for ``""``) one more rank on ``cuda`` (or a cpu rank on the cores
    left over, or sharing the last share), written as a cluster file (estimated figures)."""
    from adaptdist.calibrate.local import default_links, uniform_host
    from adaptdist.cluster import Cluster, Host
    from adaptdist.cluster_file import save_cluster
    import dataclasses

    share = max(1, len(cores) // max(1, cpu_ranks + (accelerator == "cpu")))
    devices = []
    if cpu_ranks:
        for i, d in enumerate(uniform_host("localhost", "cpu", cpu_ranks).devices):
            devices.append(dataclasses.replace(d, cpus=tuple(cores[i * share:(i + 1) * share]) or (cores[-1],)))
    if accelerator:
        extra = uniform_host("localhost", accelerator, 1, first_rank=cpu_ranks).devices[0]
        if accelerator == "cpu":
            left = tuple(cores[cpu_ranks * share:(cpu_ranks + 1) * share]) or (cores[-1],)
            extra = dataclasses.replace(extra, cpus=left)
        devices.append(extra)
    hosts = (Host("localhost", tuple(devices)),)
    save_cluster(Cluster(hosts, default_links(hosts)), path)
    return path


def device_figures(args) -> int:
    """``--device-figures``: GPU-only, CPU-only and heterogeneous samples/s on this machine (module docstring).
    Returns the number of runs that failed (device_check.sh reports the step failed when any did)."""
    from adaptdist.runtime.affinity import available_cpus

    cores = available_cpus()
    n = args.cpu_ranks
    print(f"# device figures: {args.steps} steps of {args.batch_size}, accelerator {args.device}"
          + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" and torch.cuda.is_available() else "")
          + f", {n} cpu ranks on {len(cores)} cores, staleness {args.max_staleness}; load average {loadavg()}",
          flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        plans = [
            ("GPU-only (1 rank, sync dp)", local_cluster_file(Path(tmp) / "gpu.yaml", 0, args.device, cores),
             ["--mode", "sync", "--plan", "dp"]),
            (f"CPU-only ({n} cpu ranks, sync dp)", local_cluster_file(Path(tmp) / "cpu.yaml", n, "", cores),
             ["--mode", "sync", "--plan", "dp"]),
            (f"heterogeneous ({n} cpu sparse ranks + 1 {args.device} dense rank, async-hetero K={args.max_staleness})",
             local_cluster_file(Path(tmp) / "hetero.yaml", n, args.device, cores),
             ["--mode", "async-hetero", "--dense-ranks", str(n), "--max-staleness", str(args.max_staleness)]),
        ]
        for name, cluster, flags in plans:
            try:
                runs.append(train(args, cluster, args.steps, flags, name))
                print(json.dumps(runs[-1]), flush=True)
            except BaseException as e:  # noqa: BLE001 - print it and go on to the next figure
                print(f"FAILED {name}: {str(e)[-2000:]}", flush=True)
                runs.append(None)
    gpu, cpu, het = runs
    print("\n| run | samples/s (mean step) | samples/s (median step) | steps | command s |")
    print("|---|---:|---:|---:|---:|")
    for r in runs:
        if r is not None:
            print(f"| {r['run']} | {r['samples_per_s']:,.0f} | {r['median_samples_per_s']:,.0f} | {r['steps']} | "
                  f"{r['command_wall_s']:.0f} |")
    if het is not None:
        for other, label, paper in ((gpu, "GPU-only", 2.1), (cpu, "CPU-only", 3.3)):
            if other is not None:
                print(f"heterogeneous / {label}: x{het['samples_per_s'] / other['samples_per_s']:.2f} "
                      f"(paper: x{paper}; {'a GPU' if args.device == 'cuda' else 'cpu ranks standing in: not a figure'})")
    failed = sum(r is None for r in runs)
    if failed:
        print(f"{failed} of {len(runs)} runs FAILED (above)", flush=True)
    return failed


def predictions(args, cluster_files: list[tuple[str, str]]) -> list[dict]:
    """The cost model's samples/s of sync, the best async layout and one rank, per cluster."""
    from adaptdist.calibrate.local import load_cluster, local_cluster
    from adaptdist.compiler.planner.modes import choose_mode, recsys_shape
    from adaptdist.cost_models.recsys import sync_cost
    from adaptdist.models import dlrm

    torch.manual_seed(args.seed)
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        model, example, _ = dlrm.factory(args.batch_size, 1, data_path=args.data)
    shape = recsys_shape(model, example, args.optimizer)
    rows = []
    for name, path in cluster_files:
        cluster = load_cluster(path) if path else local_cluster(2)
        for K in (0, 1):
            choice = choose_mode(shape, cluster, "async-hetero", K)
            sync = sync_cost(shape, cluster)
            cpu_ranks = [r for r in range(cluster.world_size) if cluster.device(r).kind == "cpu"]
            gpu_ranks = [r for r in range(cluster.world_size) if cluster.device(r).kind != "cpu"]
            row = {"cluster": name, "K": K, "async_samples_per_s": choice.cost.items_per_s,
                   "dense_ranks": list(choice.layout.dense_ranks), "sync_all_samples_per_s": sync.items_per_s,
                   "one_cpu_samples_per_s": sync_cost(shape, cluster, cpu_ranks[:1]).items_per_s}
            if gpu_ranks:
                row["gpu_only_samples_per_s"] = sync_cost(shape, cluster, gpu_ranks).items_per_s
                row["cpu_only_samples_per_s"] = sync_cost(shape, cluster, cpu_ranks).items_per_s
            rows.append(row)
    return rows


def measured_ratio(results: list[dict], K: int) -> float | None:
    """async K's samples/s over sync's, both from the mean interval between step ends (data loading included in
    both, the same measure); None where a run is missing."""
    sync = next((r for r in results if r["run"].startswith("sync")), None)
    run = next((r for r in results if r["run"].startswith(f"async-hetero K={K},")), None)
    if sync is None or run is None or not sync.get("interval_samples_per_s") or not run.get("interval_samples_per_s"):
        return None
    return run["interval_samples_per_s"] / sync["interval_samples_per_s"]


def cpu_ratio(results: list[dict], K: int) -> float | None:
    """sync's busiest-rank CPU seconds per step over async K's: the work ratio, steadier under load than the wall
    clock (the runs' ``cpu_step_s``); None where a run is missing."""
    sync = next((r for r in results if r["run"].startswith("sync")), None)
    run = next((r for r in results if r["run"].startswith(f"async-hetero K={K},")), None)
    if sync is None or run is None or not sync.get("cpu_step_s") or not run.get("cpu_step_s"):
        return None
    return sync["cpu_step_s"] / run["cpu_step_s"]


def predicted_auto(args, optimizer: str, K: int) -> tuple[str, float]:
    """What ``--mode auto`` picks on this machine's 2 local cpu ranks, and the predicted async/sync ratio."""
    import contextlib
    import io

    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.planner.modes import choose_mode, recsys_shape
    from adaptdist.cost_models.recsys import sync_cost
    from adaptdist.models import dlrm

    torch.manual_seed(args.seed)
    with contextlib.redirect_stderr(io.StringIO()):
        model, example, _ = dlrm.factory(args.batch_size, 1, data_path=args.data)
    shape = recsys_shape(model, example, optimizer)
    cluster = local_cluster(2)
    forced = choose_mode(shape, cluster, "async-hetero", K, dense_ranks=(1,))
    return choose_mode(shape, cluster, "auto", K).mode, sync_cost(shape, cluster).step_s / forced.cost.step_s


def run_optimizer(args, optimizer: str, lr: float) -> list[dict]:
    """Predictions, then the runs side by side (eager, sync, async K...), then their table, for one optimizer."""
    args = argparse.Namespace(**{**vars(args), "optimizer": optimizer, "lr": lr})
    print(f"\n## {optimizer} lr {lr:g}: {time.strftime('%H:%M:%S UTC', time.gmtime())}, load average {loadavg()}",
          flush=True)
    for row in predictions(args, [("this machine (2 local cpu ranks, uncalibrated)", ""),
                                  (Path(args.cluster).name, args.cluster)]):
        extra = ""
        if "gpu_only_samples_per_s" in row:
            extra = (f", GPU-only {row['gpu_only_samples_per_s']:,.0f}, CPU-only {row['cpu_only_samples_per_s']:,.0f}"
                     f" -> async/GPU-only x{row['async_samples_per_s'] / row['gpu_only_samples_per_s']:.2f}, "
                     f"async/CPU-only x{row['async_samples_per_s'] / row['cpu_only_samples_per_s']:.2f}")
        print(f"predicted {row['cluster']} K={row['K']}: async-hetero (dense ranks {row['dense_ranks']}) "
              f"{row['async_samples_per_s']:,.0f} samples/s, sync on all {row['sync_all_samples_per_s']:,.0f}, one cpu "
              f"rank {row['one_cpu_samples_per_s']:,.0f}{extra}", flush=True)
    if args.skip_runs:
        return []
    from adaptdist.data import movielens as ml

    steps = args.epochs * ml.steps_per_epoch(ml.resolve(args.data).split()[0].numel(), args.batch_size)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = pinned_cluster(Path(tmp))
        results.append(one_process(args))
        print(json.dumps(results[-1]), flush=True)
        results.append(train(args, cluster, steps, ["--mode", "sync", "--plan", "dp", "--threads-per-rank", "1"],
                             "sync, --plan dp, 2 ranks (cores 0, 1)"))
        print(json.dumps(results[-1]), flush=True)
        for K in (int(k) for k in args.staleness.split(",")):
            results.append(train(args, cluster, steps, ["--mode", "async-hetero", "--max-staleness", str(K),
                                                        "--dense-ranks", "1", "--threads-per-rank", "1"],
                                 f"async-hetero K={K}, rank 0 sparse (core 0), rank 1 dense (core 1)"))
            print(json.dumps(results[-1]), flush=True)
    base = results[0]["samples_per_s"]
    sync = results[1]
    print(f"\n# {optimizer}: {args.epochs} epochs ({steps} steps of {args.batch_size}); load average at the end "
          f"{loadavg()}")
    print("| run | samples/s (mean step) | x 1 process | x sync | samples/s (median step) | samples/s (mean interval, "
          "data included) | busiest rank's CPU ms/step | validation RMSE | vs sync's RMSE |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        interval = r.get("interval_samples_per_s")
        cpu = r.get("cpu_step_s")
        print(f"| {r['run']} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / base:.2f} | "
              f"{r['samples_per_s'] / sync['samples_per_s']:.2f} | {r['median_samples_per_s']:,.0f} | "
              f"{f'{interval:,.0f}' if interval else '-'} | {f'{1e3 * cpu:.2f}' if cpu else '-'} | "
              f"{r['validation_rmse']:.4f} | {100 * (r['validation_rmse'] / sync['validation_rmse'] - 1):+.2f}% |")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate")
    ap.add_argument("--sgd-lr", type=float, default=0.05, help="SGD's learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", default="adamw,sgd",
                    help="adamw, sgd or both (comma-separated; sgd: the sparse ranks update only the rows a batch "
                         "touched, AdamW's state is dense)")
    ap.add_argument("--staleness", default="0,1,4")
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "clusters" / "cpu_hosts_and_gpus.yaml"))
    ap.add_argument("--skip-runs", action="store_true", help="only the cost model's predictions")
    ap.add_argument("--device-figures", action="store_true",
                    help="GPU-only, CPU-only and heterogeneous samples/s on this machine (device_check.sh)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--device-figures: the accelerator rank")
    ap.add_argument("--cpu-ranks", type=int, default=4, help="--device-figures: cpu ranks (CPU-only; the sparse ranks)")
    ap.add_argument("--steps", type=int, default=200, help="--device-figures: steps of each run")
    ap.add_argument("--max-staleness", type=int, default=1, help="--device-figures: the heterogeneous run's K")
    ap.add_argument("--run-timeout-s", type=float, default=None, help="each `adaptdist train` run's time limit")
    args = ap.parse_args()
    if args.device_figures:
        if device_figures(argparse.Namespace(**{**vars(args), "optimizer": "adamw"})):
            raise SystemExit(1)
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average {loadavg()}, torch "
          f"{torch.__version__}, {os.cpu_count()} cores; data {args.data or 'builtin:dlrm default'}; "
          f"batch {args.batch_size}, {args.epochs} epochs", flush=True)
    measured = {}
    optimizers = [o.strip() for o in args.optimizer.split(",")]
    for opt in optimizers:
        if opt not in ("adamw", "sgd"):
            raise SystemExit(f"--optimizer: adamw or sgd, got {opt!r}")
        measured[opt] = run_optimizer(args, opt, args.lr if opt == "adamw" else args.sgd_lr)
    print(f"\n# the cost model against the runs (async K / sync samples/s; measured: mean intervals, data loading "
          f"included in both); load average at the end {loadavg()}")
    print("| optimizer | K | predicted async/sync | measured async/sync (wall) | measured sync/async (busiest rank's "
          "CPU per step) | --mode auto picks | faster by the wall clock | cheaper by CPU |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    for opt in optimizers:
        for K in (int(k) for k in args.staleness.split(",")):
            pick, predicted = predicted_auto(args, opt, K)
            got, cpu = measured_ratio(measured[opt], K), cpu_ratio(measured[opt], K)
            faster = "-" if got is None else ("async-hetero" if got > 1 else "sync")
            cheaper = "-" if cpu is None else ("async-hetero" if cpu > 1 else "sync")
            print(f"| {opt} | {K} | {predicted:.2f} | {'-' if got is None else f'{got:.2f}'} | "
                  f"{'-' if cpu is None else f'{cpu:.2f}'} | {pick} | {faster} | {cheaper} |")


if __name__ == "__main__":
    main()
