"""``adaptdist train --nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT [--nproc P]``: one job over several hosts.

Run the same command on every host (torchrun's semantics per host): each host starts ``P`` ranks (``--nproc``,
default 1) and the hosts meet in torch's c10d rendezvous at ``HOST:PORT``, whose store is hosted by the
command on the host that has that address (bound to it alone; it is unauthenticated: anyone who reaches the
port can join or disturb the job, so keep it on a private network). With ``--nnodes MIN:MAX`` hosts may leave
(die, be cut off) and join; the rest re-form, re-plan for the new world size and resume from the newest
checkpoint.

Nothing is compiled before launch (the world size is known only at the rendezvous): the ranks plan and lower
their programs at every (re)start through :class:`adaptdist.compiler.replan.ProgramSource`
(``base_world_size=0``, ``ranks_per_host=P``), cached in ``OUT/programs_cache``.

``--out`` must be one directory that every host sees at the same path (a shared mount). A multi-host run never
clears it: the first host to arrive creates ``OUT/run.json`` (atomically, exclusively) with the settings and
the job's id; a host that finds one joins that run when the job id and settings are the same and the run is not
complete (so the same command, run again after a failure, continues the run from its newest checkpoint), and
refuses otherwise (use a fresh --out, or --resume OUT). The host that holds rank 0 at the end writes
``model.safetensors``, ``summary.json`` and marks the run complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..errors import RuntimeLaunchError, UsageError

HOSTS_KEY = "hosts"
"""The section of ``run.json`` that describes a multi-host job (endpoint, nnodes, ranks per host, job id)."""


def add_host_arguments(t) -> None:
    """``train``'s multi-host flags (``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--local-addr``)."""
    from .train import nproc_range

    g = t.add_argument_group("several hosts (run the same command on every host)")
    g.add_argument("--nnodes", type=nproc_range, default=None, metavar="N|MIN:MAX",
                   help="hosts in the job (torchrun's --nnodes): each starts --nproc ranks (default 1); MIN:MAX: "
                        "hosts may leave or join and the rest re-form, re-planned and resharded")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                   help="the c10d rendezvous: the address of one of the hosts (which hosts the store, bound to that "
                        "address alone; unauthenticated: keep it on a private network) and a free port there")
    g.add_argument("--rdzv-id", metavar="ID", default=None,
                   help="the job's id, the same on every host (default: derived from --rdzv-endpoint)")
    g.add_argument("--local-addr", metavar="ADDR", default=None,
                   help="this host's IPv4 address on the network the hosts share (gloo's interface is the one that "
                        "holds it, unless GLOO_SOCKET_IFNAME is set); default: the source address of the route to "
                        "the endpoint")


def _settings(args) -> dict:
    from .train import RESTORED

    return {k: getattr(args, k, None) for k in (*RESTORED, "steps")}


def _host_job(args, nproc: int, nnodes: tuple[int, int]) -> dict:
    from ..runtime.launch import split_endpoint

    host, port = split_endpoint(args.rdzv_endpoint)
    return {"endpoint": f"{host}:{port}", "nnodes": list(nnodes), "nproc_per_host": nproc,
            "job": args.rdzv_id or f"adaptdist-{host}-{port}"}


def _write_exclusive(path: Path, text: str) -> bool:
    """Write ``path`` atomically unless it exists; returns whether this call created it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # fails when path exists: the first host wins
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def claim_out_dir(out: Path, settings: dict, job: dict, resume: bool) -> dict:
    """This host's claim on the shared ``--out`` of a multi-host run; returns the run's ``run.json``.

    A fresh (or empty) OUT: the first host creates ``run.json`` (state ``running``, the settings, the job, the
    attempt number the launch starts at). An existing one is joined when its job id and settings equal these and
    it is not complete, or with ``resume`` (the run's own settings were restored by the caller); nothing in OUT
    is ever removed.

    Raises:
        UsageError: OUT holds another run, a finished one, or outputs without a ``run.json``.
    """
    from ..runtime.worker import _next_attempt
    from .train import OUTPUTS, RUN_FILE, RUN_FILE_VERSION

    f = out / RUN_FILE
    fresh = {"version": RUN_FILE_VERSION, "state": "running", "settings": settings, HOSTS_KEY: job,
             "first_attempt": _next_attempt(str(out))}
    if not f.exists():
        stray = [n for n in OUTPUTS if n != RUN_FILE and (out / n).exists()]
        if stray and not resume:
            raise UsageError(f"--out {out} holds outputs of an earlier run ({', '.join(stray)}) but no {RUN_FILE}; a "
                             "multi-host run never clears --out (another host may be using it): pass a fresh --out")
        if _write_exclusive(f, json.dumps(fresh, indent=1, default=list)):
            return fresh
    for _ in range(50):  # another host is writing it: read it whole
        try:
            run = json.loads(f.read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.1)
    else:
        raise UsageError(f"--out {out}: {f} cannot be read; pass a fresh --out")
    same_job = run.get(HOSTS_KEY, {}).get("job") == job["job"]
    same = run.get("settings") == json.loads(json.dumps(settings, default=list))
    if resume:  # the first host to arrive marks it running (a later one finds it so and joins)
        if run.get("state") != "running" or not same or not same_job:
            first = run.get("first_attempt", 0) if run.get("state") == "running" else _next_attempt(str(out))
            run = {**run, "state": "running", "settings": json.loads(json.dumps(settings, default=list)),
                   "first_attempt": first, HOSTS_KEY: job}
            tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(run, indent=1, default=list))
            tmp.replace(f)
        return run
    if run.get("state") == "complete" or not same_job or not same:
        why = ("it is complete" if run.get("state") == "complete" else
               f"its job is {run.get(HOSTS_KEY, {}).get('job')!r}, not {job['job']!r}" if not same_job else
               "its settings differ from this command's")
        raise UsageError(f"--out {out} holds another run ({why}); a multi-host run never clears --out: pass a fresh "
                         f"--out, or --resume {out} to continue that run (with more --steps when it is complete)")
    return run


def cmd_train_hosts(args, defaults: dict, console) -> int:
    """``adaptdist train --nnodes ... --rdzv-endpoint ...`` on one host (see the module docstring).

    Raises:
        UsageError: missing or conflicting flags, an --out that holds another run.
        RuntimeLaunchError: the job failed past its restarts, or this host lost it; names the rank and why
            and the command to continue.
    """
    from ..compiler.replan import ProgramSource
    from ..model_spec import ModelSpec
    from ..runtime.launch import launch_hosts
    from ..runtime.stop import interrupted_exit_code
    from ..runtime.timeouts import Timeouts
    from ..runtime.worker import DataSpec, TrainConfig, run_worker
    from .common import lowering_options
    from .train import _restored_args

    if not args.rdzv_endpoint:
        raise UsageError("--nnodes needs --rdzv-endpoint HOST:PORT (the address of the host that holds the "
                         "rendezvous store, the same on every host)")
    if args.join:
        raise UsageError("--join adds a rank to a local elastic job; to add a host to a multi-host job run the "
                         "same adaptdist train --nnodes MIN:MAX ... command on it")
    resume = args.resume is not None
    if resume:
        given_nproc = args.nproc
        _restored_args(args, defaults)
        from .common import check_comm

        check_comm(args)  # the run's --comm, before any capture
        args.nproc = given_nproc if given_nproc is not None else args.nproc
        if args.out == defaults.get("out"):
            args.out = args.resume
    if args.cluster:
        raise UsageError("--nnodes describes the hosts itself (--nproc ranks each); it takes no --cluster")
    nproc = 1 if args.nproc is None else args.nproc
    if isinstance(nproc, (tuple, list)):
        raise UsageError(f"--nproc {nproc[0]}:{nproc[1]} with --nnodes: the elastic range is over hosts "
                         "(--nnodes MIN:MAX); give --nproc the ranks per host")
    nnodes = tuple(args.nnodes) if isinstance(args.nnodes, (tuple, list)) else (args.nnodes, args.nnodes)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    timeouts = Timeouts.for_collective(args.collective_timeout_s)
    spec = ModelSpec.parse(args.model)
    from .common import prepare_out_dir

    out = prepare_out_dir(args.out)
    settings = _settings(args)
    settings.update(nproc=nproc, cluster=None)
    job = _host_job(args, nproc, nnodes)
    source = ProgramSource(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                           plan=args.plan, mesh=args.mesh, optimizer=args.optimizer,
                           cache_dir=str(out / "programs_cache"), base_world_size=0, base_program_dir="",
                           options=lowering_options(args), ranks_per_host=nproc,
                           compile_wait_s=timeouts.compile_wait_s, data_path=args.data)
    source.check_elastic()
    module = spec.module()
    if not callable(getattr(module, "data", None)):
        raise UsageError(f"{spec.file} defines no data(batch_size, seq_len, ...) function; a multi-host run needs "
                         "one (every rank reads the same global batches)")
    data = DataSpec(str(spec.file), "data", args.batch_size, args.seq_len, path=args.data, seed=args.seed)
    run = claim_out_dir(out, settings, job, resume)
    import torch

    torch.manual_seed(args.seed)
    model, example, _ = spec.build(args.batch_size, args.seq_len, data_path=args.data)
    import dataclasses

    from ..runtime.batch_check import batch_shapes

    data = dataclasses.replace(data, batch_shapes=batch_shapes(example))  # every rank checks every batch against it
    from ..throughput import throughput_unit

    unit, items_per_step = throughput_unit(example, model)
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    cfg = TrainConfig(first_attempt=int(run.get("first_attempt", 0)), program_dir="", out_dir=str(out), data=data,
                      steps=args.steps, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                      threads_per_rank=threads, timeout_s=timeouts.collective_s, backend="gloo",
                      items_per_step=items_per_step, unit=unit, max_grad_norm=args.max_grad_norm,
                      checkpoint_every=args.checkpoint_every, keep=args.keep, model_name=spec.text,
                      program_source=source, run_meta={"hosts": job, "config": settings})
    import dataclasses

    cfg = dataclasses.replace(cfg, rng=source.options.rng)  # --rng global: every rank seeds alike (worker.py)
    console.print(f"model {spec.text}; this host: {nproc} rank(s), joining {nnodes[0]}"
                  f"{f' to {nnodes[1]}' if nnodes[1] != nnodes[0] else ''} host(s) at {job['endpoint']} "
                  f"(job {job['job']}); --out {out} (shared by every host)")
    t0 = time.perf_counter()
    try:
        results = launch_hosts(run_worker, (cfg,), nproc, nnodes[0], nnodes[1], args.rdzv_endpoint,
                               max_restarts=args.max_restarts, timeouts=timeouts, local_addr=args.local_addr,
                               run_id=job["job"])
    except BaseException as e:
        code = interrupted_exit_code(e)
        from ..runtime.checkpoint_store import latest_good

        info = latest_good(out / "checkpoints")
        where = f"checkpoint at {info.path}" if info else "no checkpoint yet"
        again = (f"run the same command on every host again (it continues the run in {out} from its newest "
                 "checkpoint)")
        if code is not None:
            print(f"adaptdist: interrupted on this host, {where}; to continue: {again}", file=sys.stderr)
            return code
        if isinstance(e, RuntimeLaunchError):
            raise RuntimeLaunchError(f"{e}; {where}; to continue: {again}") from None
        raise
    wall = time.perf_counter() - t0
    if 0 not in results:
        console.print(f"this host's ranks {sorted(results)} finished in {wall:.0f} s; the host of rank 0 writes "
                      f"{out / 'summary.json'} and {out / 'model.safetensors'}")
        return 0
    result = results[0]
    write_summary(out, result, wall, threads, args.plan, unit)
    console.print(f"trained {len(result['losses'])} steps on {result['world_size']} ranks in {wall:.0f} s; "
                  f"{len(json.loads((out / 'summary.json').read_text())['restarts'])} restart(s); weights "
                  f"{out / 'model.safetensors'}")
    return 0


def write_summary(out: Path, result: dict, wall_s: float, threads: int, plan: str, unit: str) -> None:
    """``OUT/summary.json`` of a finished multi-host run (rank 0's ``result``), then ``run.json`` complete
    (:func:`adaptdist.cli.train.write_summary`)."""
    from .train import write_summary as write

    write(out, result, wall_s, **{f"{unit}_per_s": result["items_per_s"]}, step_time_s=result["step_time_s"],
          ranks=result["world_size"], threads_per_rank=threads, plan=plan)
