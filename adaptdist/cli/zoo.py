"""``adaptdist zoo``: every zoo model (:mod:`adaptdist.models.zoo`) under every plan, through both front ends,
against single-process eager PyTorch.

For each model x plan (``auto``, ``dp``, ``fsdp``, ``tp`` where the model has a ``TP_PLAN``) x front end:

* ``backend``: ``torch.compile(model, backend=adaptdist.backend(plan=...))`` in real gloo processes
  (:func:`~adaptdist.runtime.launch.launch_local`, all plans of one model in one process group), each rank
  its own rows of the global batch (DDP's contract), ``steps`` SGD steps. Eager's reference: each rank's
  loss on its rows, the gradients of the ranks' mean loss, the parameters after the steps.
* ``train``: ``adaptdist train MODEL.py:factory --optimizer sgd`` (a subprocess, the model file written to
  ``OUT/models``) on the model's example batch repeated. Eager's reference: the loss of the global batch per
  step and the parameters after the steps (``model.safetensors``).

Each combination is recorded as: captured, planned (and lowered), ran, equal to eager (loss, gradients —
backend only — and parameters within the model's tolerance), the plan chosen (mesh, sharded parameters,
collectives), the compile time, and for a failure the error (type and first line) and the stage it stopped
in. Outcomes: ``equal``, ``differs`` (wrong numbers: a bug), ``rng`` (a model with dropout differs by design),
``error`` (a clear error, its stage named), ``skipped`` (an optional package missing). Output: a table on
stdout, ``OUT/results.json``, ``OUT/zoo.png``; the last line ``N of M combinations equal eager``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..errors import AdaptdistError, UsageError

PLANS = ("auto", "dp", "fsdp", "tp", "ep")
FRONT_ENDS = ("backend", "train")
OUTCOMES = ("equal", "rng", "differs", "error", "timeout", "skipped")
COLOURS = {"equal": "#4caf50", "rng": "#9e9ecf", "differs": "#d32f2f", "error": "#ffb300", "timeout": "#8d6e63",
           "skipped": "#bdbdbd", "n/a": "#ffffff"}
ROWS_PER_RANK = 2


def add_zoo_parser(sub) -> None:
    """The ``zoo`` subcommand's arguments."""
    from .common import local_ranks, positive

    z = sub.add_parser("zoo", help="train every zoo model under every plan and compare with eager PyTorch",
                       description=__doc__.split("\n\n")[0])
    z.add_argument("--models", default=None, metavar="NAME,...", help="zoo models (default: all; see --list)")
    z.add_argument("--plans", default=",".join(PLANS), metavar="auto,dp,fsdp,tp,ep",
                   help="plans to sweep (tp only for models with a TP_PLAN)")
    z.add_argument("--front-ends", default=",".join(FRONT_ENDS), metavar="backend,train",
                   help="backend: torch.compile(backend=adaptdist.backend(...)); train: adaptdist train")
    z.add_argument("--ranks", type=local_ranks, default=2, help="local gloo ranks")
    z.add_argument("--steps", type=positive(int), default=2, help="SGD steps per combination")
    z.add_argument("--lr", type=positive(float), default=0.1, help="SGD learning rate")
    z.add_argument("--timeout-s", type=positive(float), default=600.0,
                   help="wall-clock limit of one launch (a model's backend plans, or one train run)")
    z.add_argument("--out", default="runs/zoo", metavar="DIR", help="results.json, zoo.png, the train runs")
    z.add_argument("--list", action="store_true", help="list the zoo models and exit")


def parse_names(text: str | None, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    """``a,b`` -> ``['a', 'b']`` (None: all of ``allowed``).

    Raises:
        UsageError: an unknown name; lists the names allowed.
    """
    if text is None:
        return list(allowed)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise UsageError(f"--{what}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {', '.join(allowed)}")
    return names


def combinations(models: list[str], plans: list[str], front_ends: list[str]) -> list[tuple[str, str, str]]:
    """The (model, plan, front end) combinations swept: ``tp`` only for models with a TP_PLAN, ``ep`` only for
    models with an EP_PLAN."""
    from ..models.zoo import get

    return [(m, p, f) for m in models for p in plans for f in front_ends
            if (p != "tp" or get(m).tp_plan) and (p != "ep" or get(m).ep_plan)]


# --- errors ----------------------------------------------------------------------------------------------

def root_error(e: BaseException) -> BaseException:
    """The error to report: the first adaptdist error in ``e``'s cause chain (Dynamo wraps a backend's error
    in BackendCompilerFailed), else the innermost cause."""
    chain, seen = [e], {id(e)}
    while True:
        nxt = getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__
        if nxt is None or id(nxt) in seen:
            break
        chain.append(nxt)
        seen.add(id(nxt))
    return next((c for c in chain if isinstance(c, AdaptdistError)), chain[-1])


def error_line(e: BaseException, limit: int = 400) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters)."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}"
    # the backend's "CaptureError: capturing the compiled graph failed on rank 0: ..." (an adaptdist error keeps
    # its type on every rank) or "AdaptdistError: ... failed on rank 0: ValueError: ...": the rank's own error
    m = re.match(r"AdaptdistError: (.*?) failed on rank (\d+): (\w+): (.*)$", line)
    t = re.match(r"(\w+): (.*?) failed on rank (\d+): (.*)$", line)
    if m:
        line = f"{m.group(3)}: {m.group(4)} (rank {m.group(2)}, {m.group(1)})"
    elif t:
        line = f"{t.group(1)}: {t.group(4)} (rank {t.group(3)}, {t.group(2)})"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _compile_stage(e: BaseException) -> str:
    """``capture`` or ``plan`` for an error raised inside the backend's compile."""
    from ..errors import CaptureError

    text = str(e)
    if isinstance(e, CaptureError) or "capturing the compiled graph failed" in text or "CaptureError" in text:
        return "capture"
    return "plan"


# --- the backend front end, in each rank ----------------------------------------------------------------

RNG_SEED = 1234  # models that draw random numbers: the seed of step s is RNG_SEED + s


def global_rng_supported() -> bool:
    """Whether ``adaptdist.backend`` takes ``rng="global"`` (random numbers independent of the world size):
    then a model with dropout is compared with eager's draws for the whole batch."""
    import inspect

    import adaptdist

    return "rng" in inspect.signature(adaptdist.backend).parameters

def _full_grad(p) -> Any:
    if p.grad is None:
        return None
    layout = getattr(p, "_adaptdist_layout", None)
    return p.grad.detach().clone() if layout is None else layout.gather(p.grad)


def _collective_kinds(calls: list[str]) -> str:
    kinds = Counter(m.group(1) if (m := re.search(r"(\w+)\.default\(", c)) else c.split("(")[0] for c in calls)
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"


def backend_case(name: str, plan: str, steps: int, lr: float, rank: int, world: int) -> dict:
    """One model under one plan through ``torch.compile(backend=adaptdist.backend(plan=...))`` on this rank:
    ``steps`` SGD steps on this rank's rows; returns the record (losses, full gradients per step, full final
    parameters, or the error and its stage)."""
    import torch

    import adaptdist
    from ..annotations import ManualPlan
    from ..compiler.dynamo_backend import GraphBreakWarning
    from ..models.zoo import get

    zm = get(name)
    rec: dict[str, Any] = {"stage": None, "error": None, "losses": [], "grads": [], "params": None,
                           "compile_s": 0.0, "graphs": 0, "graph_breaks": 0, "strategy": None, "mesh": None}
    inside = {"error": None}
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, batch, loss_fn = zm.build(ROWS_PER_RANK * world)
            plan_arg = (ManualPlan.parse(plan, SimpleNamespace(TP_PLAN=zm.tp_plan, EP_PLAN=zm.ep_plan))
                        if plan in ("tp", "ep") else plan)
            global_rng = zm.random and global_rng_supported()
            be = adaptdist.backend(plan=plan_arg, optimizer="sgd", **zm.options,
                                   **({"rng": "global"} if global_rng else {}))

            def timed(gm, example_inputs):
                t0 = time.perf_counter()
                try:
                    return be(gm, example_inputs)
                except BaseException as e:
                    inside["error"] = e
                    raise
                finally:
                    rec["compile_s"] += time.perf_counter() - t0
                    rec["graphs"] += 1

            compiled = torch.compile(model, backend=timed)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            rows = [t.chunk(world)[rank] for t in batch]
            for step in range(steps):
                if global_rng:  # every rank draws what one process draws for the whole batch from this seed
                    torch.manual_seed(RNG_SEED + step)
                loss = loss_fn(compiled(*rows[:-1]), rows[-1])
                loss.backward()
                rec["losses"].append(loss.item())
                rec["grads"].append({n: _full_grad(p) for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
            rec["params"] = {k: v.detach().clone() for k, v in adaptdist.full_state_dict(compiled).items()}
        except Exception as e:
            root = root_error(e)
            rec["error"] = error_line(root)
            rec["stage"] = (_compile_stage(root) if inside["error"] is not None else
                            "capture" if rec["graphs"] == 0 else "run")
        steps_done = getattr(be, "compiled", []) if "be" in locals() else []
        if steps_done:
            prog = steps_done[0].program
            rec["mesh"] = ",".join(f"{a}={n}" for a, n in prog.mesh.items())
            sharded = sum(1 for p in model.parameters() if getattr(p, "_adaptdist_layout", None) is not None)
            calls = [c for s in steps_done for c in s.collectives()]
            name_of = prog.plan.name if prog.plan is not None else "unnamed"
            rec["strategy"] = (f"{name_of} on {rec['mesh']}; {sharded}/{len(list(model.parameters()))} params "
                               f"sharded; {_collective_kinds(calls)}")
        rec["graph_breaks"] = sum(1 for w in caught if issubclass(w.category, GraphBreakWarning))
    rec["wall_s"] = time.perf_counter() - t_start
    return rec


def backend_worker(name: str, plans: list[str], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    """(In each rank) :func:`backend_case` for each plan, in one gloo process group; Dynamo's caches reset
    between plans."""
    import torch
    import torch.distributed as dist

    from .. import _torch_compat as compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = []
        for plan in plans:
            compat.dynamo_reset()
            out.append(backend_case(name, plan, steps, lr, rank, world))
            if rank != 0:  # rank 0's tensors are compared; the others' only where they differ (see _compare)
                out[-1]["params"] = out[-1]["params"] is not None
        return out
    finally:
        dist.destroy_process_group()


# --- eager references, in this process ----------------------------------------------------------------------

def eager_backend_reference(name: str, steps: int, lr: float, world: int) -> dict:
    """Per step each rank's loss on its rows and the gradients of the ranks' mean loss; the final parameters."""
    import torch

    from ..models.zoo import get

    zm = get(name)
    model, batch, loss_fn = zm.build(ROWS_PER_RANK * world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for step in range(steps):
        chunks = list(zip(*(t.chunk(world) for t in batch)))
        if zm.whole_batch and (not zm.random or global_rng_supported()):
            # synchronized BatchNorm, or the whole batch's draws (rng="global"): each rank's rows of the output
            if zm.random:
                torch.manual_seed(RNG_SEED + step)
            per_rank = [loss_fn(o, c[-1]) for o, c in zip(model(*batch[:-1]).chunk(world), chunks)]
        else:
            per_rank = [loss_fn(model(*c[:-1]), c[-1]) for c in chunks]
        (sum(per_rank) / world).backward()
        losses.append([v.item() for v in per_rank])
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def eager_train_reference(name: str, steps: int, lr: float, world: int) -> dict:
    """Per step the loss of the global batch; the final parameters (SGD)."""
    import torch

    from ..models.zoo import get

    model, batch, loss_fn = get(name).build(ROWS_PER_RANK * world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _max_diff(got: dict, want: dict) -> tuple[float, list[str]]:
    """The largest absolute difference over ``want``'s tensors, and the names missing from ``got`` or of
    another shape (counted as infinitely different)."""
    worst, bad = 0.0, []
    for n, w in want.items():
        g = got.get(n)
        if w is None and g is None:
            continue
        if w is None or g is None or tuple(g.shape) != tuple(w.shape):
            bad.append(n)
            continue
        worst = max(worst, float((g.double() - w.double()).abs().max()) if w.numel() else 0.0)
    return (float("inf") if bad else worst), bad


def judge(rec: dict, diffs: dict[str, float], tol: float, random: bool, missing: list[str]) -> None:
    """Set ``rec``'s ``outcome``, ``equal`` and ``diffs`` from the differences to eager."""
    rec["diffs"] = diffs
    rec["equal"] = all(v <= tol for v in diffs.values())
    rec["outcome"] = "equal" if rec["equal"] else "rng" if random else "differs"
    if not rec["equal"] and not random:
        worst = max(diffs, key=lambda k: diffs[k])
        rec["error"] = (f"differs from eager: max |{worst} - eager| = {diffs[worst]:.3g} > {tol:g}"
                        + (f" (missing or misshapen: {', '.join(missing[:3])})" if missing else ""))
    elif not rec["equal"]:
        rec["error"] = "differs by design (rng): dropout masks are drawn per rank"


def compare_backend(results: dict[int, dict], ref: dict, tol: float, random: bool) -> dict:
    """One combination's record from every rank's :func:`backend_case` record and eager's reference."""
    r0 = results[0]
    rec = {k: r0[k] for k in ("stage", "error", "compile_s", "graphs", "graph_breaks", "strategy", "mesh", "wall_s")}
    rec["losses"] = [[results[r]["losses"][s] if s < len(results[r]["losses"]) else None for r in sorted(results)]
                     for s in range(len(r0["losses"]))]
    errors = {r: v["error"] for r, v in results.items() if v["error"]}
    if errors:  # the first rank's error; another rank's when rank 0 had none
        r = min(errors)
        rec["error"], rec["stage"] = errors[r], results[r]["stage"]
    rec["captured"] = rec["stage"] not in ("capture",)
    rec["planned"] = rec["stage"] not in ("capture", "plan")
    rec["ran"] = rec["stage"] is None
    if not rec["ran"]:
        rec.update(outcome="error", equal=False)
        return rec
    d_loss = max(abs(results[r]["losses"][s] - ref["losses"][s][r]) for r in results for s in range(len(ref["losses"])))
    d_grad, missing = 0.0, []
    for r in results:
        for s, want in enumerate(ref["grads"]):
            d, bad = _max_diff(results[r]["grads"][s], want)
            d_grad, missing = max(d_grad, d), missing + bad
    d_param, bad = _max_diff(r0["params"], ref["params"])
    judge(rec, {"loss": d_loss, "grad": d_grad, "param": d_param}, tol, random, sorted(set(missing + bad)))
    if not rec["equal"] and not rec["graphs"]:
        rec["error"] += ("; Dynamo never called the adaptdist backend (0 graphs compiled): the forward ran eagerly "
                         "on each rank, its gradients never synchronised")
    return rec


# --- the train front end -------------------------------------------------------------------------------------

MODEL_FILE = '''"""Zoo model {name!r} for `adaptdist train` (written by `adaptdist zoo`)."""
from adaptdist.models.zoo import factory_of, get

TP_PLAN = get({name!r}).tp_plan or {{}}
EP_PLAN = get({name!r}).ep_plan or {{}}
factory = factory_of({name!r})
'''


def _model_file(out: Path, name: str) -> Path:
    f = out / "models" / (re.sub(r"\W", "_", name) + ".py")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(MODEL_FILE.format(name=name))
    return f


def _run_bounded(cmd: list[str], timeout_s: float, env: dict) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own session; past ``timeout_s`` its process group gets SIGTERM, then SIGKILL.
    Returns (exit code or None on timeout, stdout, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                out, err = "", ""
        return None, out or "", err or ""


COMPILED_LINE = re.compile(r"compiled plan '([^']*)' \(mesh ([^)]*)\) for \d+ ranks in ([\d.]+) s")


def train_case(name: str, plan: str, steps: int, lr: float, world: int, out: Path, timeout_s: float) -> dict:
    """``adaptdist train`` of zoo model ``name`` under ``plan`` (a subprocess; its run in ``OUT/train/...``)."""
    from ..models.zoo import SEQ_LEN, get

    run_dir = out / "train" / re.sub(r"\W", "_", name) / plan
    cmd = [sys.executable, "-m", "adaptdist.cli", "train", f"{_model_file(out, name)}:factory", "--nproc", str(world),
           "--batch-size", str(ROWS_PER_RANK * world), "--seq-len", str(SEQ_LEN), "--steps", str(steps),
           "--optimizer", "sgd", "--lr", repr(lr), "--plan", plan, "--mode", "sync", "--out", str(run_dir), "--threads-per-rank", "1",
           "--sample-bytes", "0", "--timeout-s", "120"]
    for key, value in get(name).options.items():  # backend keywords as train's flags (batch_norm -> --batch-norm)
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    t0 = time.perf_counter()
    rc, _, err = _run_bounded(cmd, timeout_s, dict(os.environ))
    rec: dict[str, Any] = {"stage": None, "error": None, "compile_s": None, "graphs": 1, "graph_breaks": 0,
                           "strategy": None, "mesh": None, "wall_s": time.perf_counter() - t0, "losses": []}
    (run_dir.parent / f"{plan}.stderr.txt").write_text(err)
    m = COMPILED_LINE.search(err)
    if m:
        rec["mesh"], rec["compile_s"] = m.group(2), float(m.group(3))
        rec["strategy"] = f"{m.group(1)} on {m.group(2)}"
    summary = run_dir / "summary.json"
    if rc == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        rec["losses"] = s["losses"]
        rec.update(captured=True, planned=True, ran=True)
        return rec
    errors = [ln.removeprefix("adaptdist: error: ") for ln in err.splitlines() if ln.startswith("adaptdist: error: ")]
    tail = [ln for ln in err.splitlines() if ln.strip()]
    if rc is None:
        rec["error"], rec["outcome"] = f"TimeoutError: adaptdist train ran past {timeout_s:g} s", "timeout"
    else:
        rec["error"] = errors[0] if errors else (tail[-1] if tail else f"exit code {rc}")
    if len(rec["error"]) > 400:
        rec["error"] = rec["error"][:397] + "..."
    rec["stage"] = "run" if m else ("capture" if rec["error"].startswith("CaptureError") else "plan")
    rec.update(captured=rec["stage"] != "capture", planned=bool(m), ran=False, equal=False)
    rec.setdefault("outcome", "error")
    return rec


def compare_train(rec: dict, out_dir: Path, ref: dict, tol: float, random: bool) -> dict:
    """Judge a train run that finished: its losses per step and ``model.safetensors`` against eager's."""
    from safetensors.torch import load_file

    if not rec.get("ran"):
        return rec
    d_loss = max((abs(a - b) for a, b in zip(rec["losses"], ref["losses"])), default=float("inf"))
    if len(rec["losses"]) != len(ref["losses"]):
        d_loss = float("inf")
    weights = out_dir / "model.safetensors"
    got = load_file(str(weights)) if weights.is_file() else {}
    want = {k: v for k, v in ref["params"].items() if k in got} if got else ref["params"]
    d_param, bad = _max_diff(got, want)
    judge(rec, {"loss": d_loss, "param": d_param}, tol, random, bad)
    return rec


# --- the sweep --------------------------------------------------------------------------------------------

def sweep(models: list[str], plans: list[str], front_ends: list[str], ranks: int, steps: int, lr: float,
          out: Path, timeout_s: float, progress=None) -> list[dict]:
    """Every combination's record (see the module docstring), in the order of :func:`combinations`.
    ``progress(k, total, record)`` is called after each."""
    from ..models.zoo import get, unavailable
    from ..runtime.launch import launch_local
    from ..runtime.timeouts import Timeouts

    todo = combinations(models, plans, front_ends)
    records: list[dict] = []

    def done(rec: dict) -> None:
        records.append(rec)
        if progress is not None:
            progress(len(records), len(todo), rec)

    for name in models:
        zm = get(name)
        mine = [(p, f) for m, p, f in todo if m == name]
        base = {"model": name, "tolerance": zm.tolerance, "description": zm.description}
        why = unavailable(zm)
        if why:
            for p, f in mine:
                done({**base, "plan": p, "front_end": f, "outcome": "skipped", "error": why, "captured": False,
                      "planned": False, "ran": False, "equal": False})
            continue
        backend_plans = [p for p, f in mine if f == "backend"]
        if backend_plans:
            t0 = time.perf_counter()
            try:
                results = launch_local(backend_worker, (name, backend_plans, steps, lr, min(timeout_s, 120.0)),
                                       ranks, timeouts=Timeouts.for_collective(min(timeout_s, 120.0)))
                ref = eager_backend_reference(name, steps, lr, ranks)
                for k, p in enumerate(backend_plans):
                    rec = compare_backend({r: v[k] for r, v in results.items()}, ref, zm.tolerance, zm.random)
                    done({**base, "plan": p, "front_end": "backend", **rec})
            except Exception as e:  # the launch itself failed (a rank crashed): every plan of the model
                line = error_line(root_error(e))
                for p in backend_plans:
                    done({**base, "plan": p, "front_end": "backend", "outcome": "error", "stage": "run",
                          "error": f"the ranks' launch failed: {line}", "captured": False, "planned": False,
                          "ran": False, "equal": False, "wall_s": time.perf_counter() - t0})
        train_plans = [p for p, f in mine if f == "train"]
        if train_plans:
            ref = eager_train_reference(name, steps, lr, ranks)
            for p in train_plans:
                rec = train_case(name, p, steps, lr, ranks, out, timeout_s)
                rec = compare_train(rec, out / "train" / re.sub(r"\W", "_", name) / p, ref, zm.tolerance, zm.random)
                done({**base, "plan": p, "front_end": "train", **rec})
    order = {c: k for k, c in enumerate(todo)}
    return sorted(records, key=lambda r: order[(r["model"], r["plan"], r["front_end"])])


def counts(records: list[dict]) -> tuple[int, int, Counter]:
    """(combinations equal to eager, combinations counted (all but skipped ones), outcomes counted)."""
    outcomes = Counter(r["outcome"] for r in records)
    counted = [r for r in records if r["outcome"] != "skipped"]
    return sum(1 for r in counted if r["outcome"] == "equal"), len(counted), outcomes


def _tick(v: Any) -> str:
    return "[green]yes[/]" if v is True else "[red]no[/]" if v is False else "-"


def print_table(records: list[dict], console) -> None:
    """The results as a rich table."""
    from rich.markup import escape
    from rich.table import Table

    styles = {"equal": "green", "rng": "blue", "differs": "bold red", "error": "yellow", "timeout": "red",
              "skipped": "dim"}
    t = Table(title="adaptdist zoo: each model x plan x front end against eager", show_lines=False)
    for col in ("model", "plan", "front end", "captured", "planned", "ran", "equal", "outcome", "chosen plan",
                "compile s", "error (stage: type: first line)"):
        t.add_column(col, overflow="fold")
    for r in records:
        oc = r["outcome"]
        compile_s = r.get("compile_s")
        err = r.get("error") or ""
        if len(err) > 160:
            err = err[:157] + "..."
        if err and r.get("stage"):
            err = f"{r['stage']}: {err}"
        t.add_row(r["model"], r["plan"], r["front_end"], _tick(r.get("captured")), _tick(r.get("planned")),
                  _tick(r.get("ran")), _tick(r.get("equal")), f"[{styles.get(oc, '')}]{oc}[/]",
                  escape(r.get("strategy") or ""), f"{compile_s:.1f}" if compile_s is not None else "-",
                  escape(err))
    console.print(t)


def write_png(records: list[dict], path: Path) -> None:
    """A model x (front end, plan) grid, each cell coloured by outcome."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    models = list(dict.fromkeys(r["model"] for r in records))
    cols = list(dict.fromkeys((r["front_end"], r["plan"]) for r in records))
    cell = {(r["model"], r["front_end"], r["plan"]): r["outcome"] for r in records}
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 2.5, 0.42 * len(models) + 1.8))
    for i, m in enumerate(models):
        for j, (f, p) in enumerate(cols):
            oc = cell.get((m, f, p), "n/a")
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=COLOURS[oc], edgecolor="white", linewidth=2))
            if oc not in ("equal", "n/a"):
                ax.text(j + 0.5, i + 0.5, oc, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(models), 0)
    ax.set_xticks([j + 0.5 for j in range(len(cols))], [f"{f}\n{p}" for f, p in cols], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(models))], models, fontsize=8)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    n, total, _ = counts(records)
    ax.set_title(f"adaptdist zoo: {n} of {total} combinations equal eager", fontsize=10)
    present = [o for o in OUTCOMES if any(r["outcome"] == o for r in records)]
    ax.legend(handles=[Patch(facecolor=COLOURS[o], label=o) for o in present], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_zoo(args) -> int:
    """``adaptdist zoo``: see the module docstring.

    Raises:
        UsageError: an unknown model, plan or front end (the message lists the names).
    """
    from ..console import report_console
    from ..models.zoo import ZOO, unavailable

    console, err_console = report_console(), report_console(stderr=True)
    if args.list:
        for name, zm in ZOO.items():
            why = unavailable(zm)
            console.print(f"{name:14} {zm.description}{'; tp' if zm.tp_plan else ''}{f' (skipped: {why})' if why else ''}")
        return 0
    models = parse_names(args.models, list(ZOO), "models")
    plans = parse_names(args.plans, PLANS, "plans")
    front_ends = parse_names(args.front_ends, FRONT_ENDS, "front-ends")
    from .common import prepare_out_dir

    out = prepare_out_dir(args.out)
    total = len(combinations(models, plans, front_ends))
    err_console.print(f"adaptdist zoo: {len(models)} models, plans {','.join(plans)}, front ends "
                      f"{','.join(front_ends)}: {total} combinations on {args.ranks} ranks, {args.steps} SGD steps")
    t0 = time.perf_counter()
    partial: list[dict] = []

    def progress(k: int, n: int, rec: dict) -> None:
        partial.append(rec)  # results.json so far: a sweep stopped early keeps what it measured
        (out / "results.json").write_text(json.dumps({"complete": False, "records": partial}, indent=1, default=str))
        oc = rec["outcome"]
        detail = f": {rec.get('stage')}: {rec['error']}" if oc in ("error", "timeout", "differs") else ""
        err_console.print(f"[{k}/{n}] {rec['model']} {rec['plan']} {rec['front_end']}: {oc}{detail} "
                          f"({time.perf_counter() - t0:.0f} s)", markup=False, highlight=False)

    records = sweep(models, plans, front_ends, args.ranks, args.steps, args.lr, out, args.timeout_s, progress)
    n, counted, outcomes = counts(records)
    doc = {"complete": True, "ranks": args.ranks, "steps": args.steps, "lr": args.lr, "wall_s": time.perf_counter() - t0,
           "equal": n, "combinations": counted, "outcomes": dict(outcomes), "records": records}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    write_png(records, out / "zoo.png")
    print_table(records, console)
    console.print("outcomes: " + ", ".join(f"{k} {outcomes[k]}" for k in OUTCOMES if outcomes[k])
                  + f"; results {out / 'results.json'}, grid {out / 'zoo.png'}", highlight=False)
    print(f"{n} of {counted} combinations equal eager", flush=True)
    return 0
