"""Inject faults into small `adaptdist train` runs and check that every one recovers, loses no step and ends with
the parameters of a fault-free run (issue 13, point 6).

A script, never collected by pytest (``testpaths = ["tests"]`` and no ``test_`` prefix; ``__test__ = False``
for good measure): it starts a few hundred processes and takes 20-40 minutes on 2 loaded cores.

    .venv/bin/python benchmarks/bench_faults.py [--quick] [--seeds N] [--out DIR] [--only METHOD,...]
    .venv/bin/python benchmarks/bench_faults.py --merge DIR1 DIR2 --out DIR   # parts of one run, one table

Writes DIR/bench_faults.json (every row, with its command and events) and DIR/bench_faults.md (the tables), and
exits 1 unless every fault recovered with no step lost.

Setup: built-in GPT, ``--batch-size 4 --seq-len 16 --plan dp --optimizer sgd --lr 0.05 --threads-per-rank 1
--sample-bytes 0 --checkpoint-every 2``, 2-4 ranks on gloo, 12 steps (200 for the faults that need the run to be
going on when the benchmark acts: the launcher SIGTERM'd, ranks joining). Each run is a subprocess under a
wall-clock bound (``--bound-s``): a run that hangs is killed with its whole process tree and reported.

Faults (``ADAPTDIST_INJECT_FAULT=KIND:RANK:STEP``, :mod:`adaptdist.runtime.faults`, unless said otherwise):

- ``kill``, ``raise``: a random rank at a random step, ``--max-restarts 1``;
- ``stall``: a random rank sleeps, ``--collective-timeout-s 5 --max-restarts 1``;
- ``term``: SIGTERM to one worker, ``--max-restarts 1``;
- ``launcher-term``: the benchmark SIGTERMs ``adaptdist train`` a random 0.5-3 s into its steps, then runs
  ``adaptdist train --resume OUT``;
- ``scale 4->3``: ``--nproc 3:4``, ``lose-node`` (the rank's agent and the rank SIGKILLed);
  ``scale 4->2``: ``--nproc 2:4``, ``lose-node`` on one rank and, as soon as it fired, the benchmark SIGKILLs a
  second rank's agent and worker;
  ``scale 2->4``: ``--nproc 2:4`` started with 2 agents (the CLI starts at MAX, so the benchmark runs
  ``adaptdist.cli.main`` with ``runtime.launch.launch_elastic_local`` given ``nodes=2``), then two
  ``adaptdist train --join OUT`` once the first checkpoint exists;
- ``reshard``: 6 steps on 4 ranks, then ``--resume OUT --steps 12 --nproc K`` for K = 3, 6, 1 (dp and fsdp);
- ``truncated``: a file of the newest checkpoint cut in half, then ``--resume``: must load the previous one and
  say why;
- ``other-model``: a checkpoint of the GPT copied into a LLaMA run, then ``--resume``: must refuse, naming both;
- ``plan-cache``: after a 4->3 run, ``--resume`` at ``--nproc 3:4`` with a second lost node: the cached world-3
  programs are reused; the same with the cache entry's key edited to another cluster's: not reused.

Per row: recovered (exit 0, run complete; for the two refusals: refused with the expected message), steps
redone (steps done before the fault minus the step of the checkpoint resumed from), seconds from the fault
(fault.json's time, the SIGTERM, the first join, or the start of the resume command) to the first step done
after the resume (the ``resumed_step`` event), split into fault -> the first rank's record that it failed or
stopped (``OUT/status``: detection; none for a rank killed without a word), fault -> restart event (detection,
stopping the others, spawn, import, rendezvous, init_process_group; for a resume or a join: the resume event),
restart -> resume event (programs: loaded or re-planned;
checkpoint verify + load) and resume -> first resumed step (the first step), data lost (steps missing or
repeated in summary.json's losses, or a wrong final step count), and the final ``model.safetensors`` against the
fault-free reference of the same step count: bitwise for the same world size, to 1e-5 across world sizes.

First (``--no-anatomy`` skips it) a 2-rank restart is timed phase by phase (:func:`anatomy`): spawn, imports,
init_process_group, loading the programs, the mesh, verifying and loading the checkpoint, the first steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__test__ = False

SMALL = ["--batch-size", "4", "--seq-len", "16", "--optimizer", "sgd", "--lr", "0.05", "--threads-per-rank", "1",
         "--sample-bytes", "0", "--checkpoint-every", "2"]
STEPS = 12
LONG_STEPS = 200
ATOL_ACROSS_WORLDS = 1e-5


@dataclass
class Row:
    fault: str
    detail: str
    world: str
    injected: bool = False
    recovered: bool = False
    steps_redone: int | None = None
    fault_to_resumed_s: float | None = None
    detected_s: float | None = None
    to_restart_s: float | None = None
    restart_to_resume_s: float | None = None
    resume_to_step_s: float | None = None
    data_lost: int | None = None
    params_equal: bool | None = None
    max_abs_diff: float | None = None
    wall_s: float = 0.0
    note: str = ""
    command: str = ""
    extra: dict = field(default_factory=dict)


def _cmd(out: Path, steps: int | None, nproc: str | None, *extra: str, plan: str = "dp", model: str | None = None,
         small: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "adaptdist.cli", "train"]
    if model:
        cmd.append(model)
    cmd += ["--out", str(out)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if nproc is not None:
        cmd += ["--nproc", nproc]
    if small:
        cmd += [*SMALL, "--plan", plan]
    return cmd + list(extra)


def _kill_tree(pid: int) -> None:
    from adaptdist.runtime.launch import _kill_tree as kill

    kill(pid, signal.SIGKILL)


@dataclass
class Proc:
    rc: int | None
    wall_s: float
    stderr: str
    timed_out: bool


def _start(cmd: list[str], env: dict | None, log: Path) -> tuple[subprocess.Popen, object]:
    f = open(log, "w")
    f.write(" ".join(cmd) + "\n")
    f.flush()
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                         start_new_session=True)
    return p, f


def _finish(p: subprocess.Popen, f, log: Path, t0: float, bound_s: float) -> Proc:
    timed_out = False
    try:
        p.wait(max(1.0, bound_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(p.pid)
        p.wait(10)
    f.close()
    return Proc(p.returncode, time.monotonic() - t0, log.read_text(errors="replace"), timed_out)


def run(cmd: list[str], log: Path, bound_s: float, env: dict | None = None) -> Proc:
    t0 = time.monotonic()
    p, f = _start(cmd, env, log)
    return _finish(p, f, log, t0, bound_s)


def _events(out: Path) -> list[dict]:
    f = out / "events.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _summary(out: Path) -> dict | None:
    f = out / "summary.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _weights(out: Path):
    from safetensors.torch import load_file

    f = out / "model.safetensors"
    return load_file(str(f)) if f.is_file() else None


def compare(out: Path, ref: Path, bitwise: bool) -> tuple[bool | None, float | None]:
    """(equal, max |difference|) of the two runs' model.safetensors: bitwise or to ATOL_ACROSS_WORLDS."""
    wa, wb = _weights(out), _weights(ref)
    if wa is None or wb is None or wa.keys() != wb.keys():
        return (None if wa is None else False), None
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].numel() else 0.0 for k in wa)
    if bitwise:
        import torch

        return all(torch.equal(wa[k], wb[k]) for k in wa), diff
    return diff <= ATOL_ACROSS_WORLDS, diff


def data_lost(summary: dict | None, steps: int, ref: dict, bitwise: bool) -> tuple[int | None, str]:
    """Steps missing or repeated in the run's losses (0: every step's loss present once, the step count right);
    and a note when the losses differ from the reference's."""
    if summary is None:
        return None, ""
    losses = summary["losses"]
    lost = abs(steps - len(losses)) + abs(steps - summary["steps"])
    note = ""
    ref_losses = ref["losses"][:steps]
    if len(losses) == len(ref_losses):
        worst = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
        if (bitwise and losses != ref_losses) or worst > 1e-4:
            note = f"losses differ from the reference by up to {worst:.2e}"
    return lost, note


def timing(row: Row, out: Path, fault_time: float | None) -> None:
    """Fill the fault-to-resumed-step columns from events.jsonl, for the events after ``fault_time``."""
    if fault_time is None:
        return
    ev = [e for e in _events(out) if e["time_s"] >= fault_time - 0.01]
    first = {}
    for e in ev:
        first.setdefault(e["event"], e)
    resumed = first.get("resumed_step")
    resume = first.get("resume")
    restart = first.get("restart")
    if resumed:
        row.fault_to_resumed_s = resumed["time_s"] - fault_time
    start = restart or resume
    if start:
        row.to_restart_s = start["time_s"] - fault_time
    if restart and resume:
        row.restart_to_resume_s = resume["time_s"] - restart["time_s"]
    if resume and resumed:
        row.resume_to_step_s = resumed["time_s"] - resume["time_s"]
    if resume:
        row.extra["resumed_from_step"] = resume["step"]
        row.extra["resume_world_size"] = resume.get("world_size")
    elif restart:  # no checkpoint yet: the restart began at step 0
        row.extra["resumed_from_step"] = 0
        row.extra["resume_world_size"] = restart.get("world_size")
    ended = []  # the ranks' own records of how the attempt hit by the fault ended (failed / stopped)
    for f in (out / "status").glob("attempt*/rank*.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if r.get("state") in ("failed", "stopped") and r["time_s"] >= fault_time - 0.01:
            ended.append(r["time_s"])
    if ended and start and min(ended) <= start["time_s"]:
        row.detected_s = min(ended) - fault_time
    row.extra["events"] = [{k: v for k, v in e.items() if k in ("event", "step", "world_size", "cause", "attempt",
                                                                 "time_s")} for e in ev]


def finish_row(row: Row, out: Path, p: Proc, steps: int, ref: Path, bitwise: bool, fault_time: float | None) -> Row:
    summary = _summary(out)
    run_state = json.loads((out / "run.json").read_text())["state"] if (out / "run.json").is_file() else None
    row.recovered = p.rc == 0 and not p.timed_out and summary is not None and run_state == "complete"
    row.wall_s += p.wall_s
    ref_summary = _summary(ref)
    row.data_lost, note = data_lost(summary, steps, ref_summary, bitwise)
    row.params_equal, row.max_abs_diff = compare(out, ref, bitwise)
    timing(row, out, fault_time)
    notes = [row.note] if row.note else []
    if p.timed_out:
        notes.append(f"HUNG: killed after {p.wall_s:.0f} s")
    elif p.rc != 0:
        notes.append(f"exit {p.rc}: {_tail(p.stderr)}")
    if note:
        notes.append(note)
    row.note = "; ".join(notes)
    return row


def _tail(text: str, n: int = 2) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-400:]


def _fault_file(out: Path) -> dict | None:
    f = out / "fault.json"
    return json.loads(f.read_text()) if f.is_file() else None


class Bench:
    def __init__(self, root: Path, bound_s: float):
        self.root = root
        self.bound_s = bound_s
        self.refs: dict[tuple, Path] = {}
        self.rows: list[Row] = []
        self.n = 0
        self.anatomy: dict = {}

    def dir(self, name: str) -> Path:
        self.n += 1
        d = self.root / f"{self.n:03d}-{name}"
        shutil.rmtree(d, ignore_errors=True)
        return d

    def ref(self, world: int, steps: int, plan: str = "dp") -> Path:
        """The fault-free run of ``world`` ranks and ``steps`` steps (made once, reused)."""
        key = (world, steps, plan)
        if key not in self.refs:
            out = self.root / "refs" / f"{plan}-w{world}-s{steps}"
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            p = run(_cmd(out, steps, str(world), plan=plan), out.parent / f"{out.name}.log", self.bound_s)
            if p.rc != 0:
                raise SystemExit(f"the fault-free reference run failed ({out}): {_tail(p.stderr, 10)}")
            print(f"  reference {plan} {world} ranks {steps} steps: {p.wall_s:.1f} s", flush=True)
            self.refs[key] = out
        return self.refs[key]

    def add(self, row: Row) -> None:
        self.rows.append(row)
        ok = row.recovered and row.data_lost == 0 and row.params_equal is not False
        t = f"{row.fault_to_resumed_s:.1f} s" if row.fault_to_resumed_s is not None else "-"
        print(f"[{len(self.rows):2d}] {row.fault:14s} {row.detail:28s} {row.world:6s} "
              f"{'ok ' if ok else 'BAD'} redone={row.steps_redone} fault->step={t} wall={row.wall_s:.0f}s"
              f"{'  ' + row.note if row.note else ''}", flush=True)

    # ---- faults injected through ADAPTDIST_INJECT_FAULT, at a fixed world size -------------------------------

    def injected(self, kind: str, world: int, rank: int, step: int, *extra: str) -> Row:
        ref = self.ref(world, STEPS)
        out = self.dir(f"{kind}-w{world}")
        cmd = _cmd(out, STEPS, str(world), "--max-restarts", "1", *extra)
        env = {"ADAPTDIST_INJECT_FAULT": f"{kind}:{rank}:{step}"}
        row = Row(kind, f"rank {rank} before step {step}", str(world), command=_env_cmd(env, cmd))
        p = run(cmd, out.parent / f"{out.name}.log", self.bound_s, env)
        fault = _fault_file(out)
        row.injected = fault is not None
        finish_row(row, out, p, STEPS, ref, True, fault["time_s"] if fault else None)
        if "resumed_from_step" in row.extra:
            # a SIGTERM'd worker finishes its step and the others stop with it (a checkpoint): count from there
            stopped = [e for e in row.extra.get("events", []) if e["event"] == "stopped"]
            done = stopped[0]["step"] if stopped else step - 1
            row.steps_redone = done - row.extra["resumed_from_step"]
        restarts = (_summary(out) or {}).get("restarts", [])
        if restarts:
            row.extra["cause"] = restarts[0].get("cause")
            if f"rank {rank}" not in (restarts[0].get("cause") or ""):
                row.note = "; ".join(filter(None, [row.note, f"cause names another rank: {restarts[0].get('cause')}"]))
        self.add(row)
        return row

    # ---- the launcher SIGTERM'd, then --resume -----------------------------------------------------------------

    def launcher_term(self, world: int, delay_s: float) -> Row:
        ref = self.ref(world, LONG_STEPS)
        out = self.dir(f"launcher-term-w{world}")
        cmd = _cmd(out, LONG_STEPS, str(world))
        row = Row("launcher-term", f"SIGTERM {delay_s:.1f} s in", str(world), command=" ".join(cmd))
        t0 = time.monotonic()
        log = out.parent / f"{out.name}.log"
        p, f = _start(cmd, None, log)
        deadline = t0 + self.bound_s
        started = out / "checkpoints" / "step-00000002"
        while not started.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay_s)
        sent = None
        if p.poll() is None:
            sent = time.time()
            p.send_signal(signal.SIGTERM)
        first = _finish(p, f, log, t0, self.bound_s)
        row.injected = sent is not None
        row.wall_s += first.wall_s
        last = [line for line in first.stderr.splitlines() if line.strip()][-1:] or [""]
        row.extra["interrupted_line"] = last[0]
        ok_stop = first.rc == 143 and last[0].startswith("adaptdist: interrupted (SIGTERM) at step")
        if not ok_stop:
            row.note = f"the SIGTERM'd run ended with exit {first.rc}: {_tail(first.stderr)}"
        stopped = [e for e in _events(out) if e["event"] == "stopped"]
        resume_cmd = _cmd(out, None, None, small=False) + ["--resume", str(out)]
        resume_cmd.remove("--out"), resume_cmd.remove(str(out))
        row.command += " ; SIGTERM ; " + " ".join(resume_cmd)
        second = run(resume_cmd, out.parent / f"{out.name}.resume.log", self.bound_s)
        finish_row(row, out, second, LONG_STEPS, ref, True, sent)
        if stopped and "resumed_from_step" in row.extra:
            row.steps_redone = stopped[0]["step"] - row.extra["resumed_from_step"]
            row.extra["stopped_at_step"] = stopped[0]["step"]
        if "Traceback" in first.stderr:
            row.note = "; ".join(filter(None, [row.note, "a traceback after SIGTERM"]))
        self.add(row)
        return row

    # ---- elastic world sizes -----------------------------------------------------------------------------------

    def scale_down(self, lost: int, rank: int, step: int) -> Row:
        world = 4
        new = world - lost
        ref = self.ref(world, STEPS)
        out = self.dir(f"scale-4to{new}")
        cmd = _cmd(out, STEPS, f"{new}:{world}", "--max-restarts", "2")
        env = {"ADAPTDIST_INJECT_FAULT": f"lose-node:{rank}:{step}"}
        row = Row(f"scale 4->{new}", f"lose-node rank {rank} step {step}" + (" +1" if lost == 2 else ""),
                  f"4->{new}", command=_env_cmd(env, cmd))
        t0 = time.monotonic()
        log = out.parent / f"{out.name}.log"
        p, f = _start(cmd, env, log)
        if lost == 2:  # a second node lost right after the first: SIGKILL another rank's agent and worker
            deadline = t0 + self.bound_s
            while not (out / "fault.json").exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            other = (rank + 1) % world
            try:
                pid = json.loads((out / "status" / "attempt0" / f"rank{other}.json").read_text())["pid"]
                agent = _ppid(pid)
                for target in (agent, pid):
                    if target:
                        _kill_tree(target)
                row.extra["second_lost_rank"] = other
            except (OSError, ValueError, KeyError) as e:
                row.note = f"could not lose a second node: {e}"
        res = _finish(p, f, log, t0, self.bound_s)
        fault = _fault_file(out)
        row.injected = fault is not None
        finish_row(row, out, res, STEPS, ref, False, fault["time_s"] if fault else None)
        if "resumed_from_step" in row.extra:
            row.steps_redone = (step - 1) - row.extra["resumed_from_step"]
            if row.extra.get("resume_world_size") != new:
                row.note = "; ".join(filter(None, [row.note, f"resumed at world size "
                                                              f"{row.extra.get('resume_world_size')}, not {new}"]))
        if self._final_world(out) != new:
            row.note = "; ".join(filter(None, [row.note, f"ended at {self._final_world(out)} ranks"]))
        self.add(row)
        return row

    @staticmethod
    def _final_world(out: Path):
        s = _summary(out)
        return s.get("ranks") if s else None

    def scale_up(self, join_after_step: int) -> Row:
        ref = self.ref(2, LONG_STEPS)
        out = self.dir("scale-2to4")
        argv = ["train", "--out", str(out), "--steps", str(LONG_STEPS), "--nproc", "2:4", *SMALL, "--plan", "dp",
                "--max-restarts", "2"]
        code = ("import functools, sys; import adaptdist.runtime.launch as L; "
                "L.launch_elastic_local = functools.partial(L.launch_elastic_local, nodes=2); "
                "from adaptdist.cli.main import main; sys.exit(main(sys.argv[1:]))")
        cmd = [sys.executable, "-c", code, *argv]
        row = Row("scale 2->4", f"2 x --join after step {join_after_step}", "2->4",
                  command=f"adaptdist train {' '.join(argv[1:])} (started with 2 agents) ; 2 x adaptdist train "
                          f"--join {out}")
        t0 = time.monotonic()
        log = out.parent / f"{out.name}.log"
        p, f = _start(cmd, None, log)
        deadline = t0 + self.bound_s
        mark = out / "checkpoints" / f"step-{join_after_step:08d}"
        while not mark.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        joins = []
        join_time = None
        if p.poll() is None and (out / "elastic.json").exists():
            join_time = time.time()
            for i in range(2):
                jp, jf = _start([sys.executable, "-m", "adaptdist.cli", "train", "--join", str(out)], None,
                                out.parent / f"{out.name}.join{i}.log")
                joins.append((jp, jf, i))
        else:
            row.note = "the run ended before the joins"
        res = _finish(p, f, log, t0, self.bound_s)
        for jp, jf, i in joins:
            j = _finish(jp, jf, out.parent / f"{out.name}.join{i}.log", t0, self.bound_s)
            row.extra[f"join{i}_rc"] = j.rc
        row.injected = join_time is not None
        finish_row(row, out, res, LONG_STEPS, ref, False, join_time)
        worlds = [e.get("world_size") for e in row.extra.get("events", []) if e["event"] == "resume"]
        row.extra["worlds_after_join"] = worlds
        if "resumed_from_step" in row.extra:
            stopped = [e for e in _events(out) if e["event"] == "stopped" and e["time_s"] >= (join_time or 0)]
            if stopped:
                row.steps_redone = stopped[0]["step"] - row.extra["resumed_from_step"]
        if self._final_world(out) != 4:
            row.note = "; ".join(filter(None, [row.note, f"ended at {self._final_world(out)} ranks, not 4 "
                                                          f"(resumes at world sizes {worlds})"]))
        self.add(row)
        return row

    # ---- resume on another world size, a truncated checkpoint, another model, the plan cache --------------------

    def reshard(self, plan: str, new_world: int) -> Row:
        ref = self.ref(4, STEPS, plan)
        out = self.dir(f"reshard-{plan}-4to{new_world}")
        first = run(_cmd(out, 6, "4", plan=plan), out.parent / f"{out.name}.first.log", self.bound_s)
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "--resume", str(out), "--steps", str(STEPS),
               "--nproc", str(new_world)]
        row = Row("reshard", f"{plan}: 6 steps on 4, resume on {new_world}", f"4->{new_world}",
                  command=" ".join(_cmd(out, 6, "4", plan=plan)) + " ; " + " ".join(cmd))
        row.injected = first.rc == 0
        row.wall_s += first.wall_s
        t = time.time()
        p = run(cmd, out.parent / f"{out.name}.log", self.bound_s)
        finish_row(row, out, p, STEPS, ref, new_world == 4, t)
        if "resumed_from_step" in row.extra:
            row.steps_redone = 6 - row.extra["resumed_from_step"]
        self.add(row)
        return row

    def truncated(self, which: str) -> Row:
        ref = self.ref(2, STEPS)
        out = self.dir("truncated-" + which.replace(" ", "-"))
        first = run(_cmd(out, 6, "2"), out.parent / f"{out.name}.first.log", self.bound_s)
        newest = out / "checkpoints" / "step-00000006"
        files = sorted((q for q in newest.rglob("*") if q.is_file() and q.name not in ("manifest.json",)),
                       key=lambda q: q.stat().st_size)
        victim = files[-1] if which == "largest file" else next(q for q in files if q.parent.name == "rng")
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "--resume", str(out), "--steps", str(STEPS)]
        row = Row("truncated", f"{which} of step 6 cut in half", "2",
                  command=" ".join(_cmd(out, 6, "2")) + f" ; truncate {victim.relative_to(out)} ; " + " ".join(cmd))
        row.injected = first.rc == 0
        row.wall_s += first.wall_s
        t = time.time()
        p = run(cmd, out.parent / f"{out.name}.log", self.bound_s)
        finish_row(row, out, p, STEPS, ref, True, t)
        named = f"{newest} is unusable" in p.stderr and "truncated" in p.stderr
        row.extra["named_why"] = named
        if "resumed_from_step" in row.extra:
            row.steps_redone = 6 - row.extra["resumed_from_step"]
            if row.extra["resumed_from_step"] != 4:
                row.recovered = False
                row.note = "; ".join(filter(None, [row.note, f"resumed from step {row.extra['resumed_from_step']}"]))
        if not named:
            row.recovered = False
            row.note = "; ".join(filter(None, [row.note, "the fallback did not name the checkpoint and why"]))
        self.add(row)
        return row

    def other_model(self) -> Row:
        gpt = self.ref(2, STEPS)
        out = self.dir("other-model")
        first = run(_cmd(out, 4, "2", model="builtin:llama"), out.parent / f"{out.name}.first.log", self.bound_s)
        shutil.copytree(gpt / "checkpoints" / "step-00000008", out / "checkpoints" / "step-00000008")
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "--resume", str(out), "--steps", str(STEPS)]
        row = Row("other-model", "GPT checkpoint in a LLaMA run", "2",
                  command=" ".join(_cmd(out, 4, "2", model="builtin:llama")) + " ; cp -r GPT/step-00000008 ; "
                  + " ".join(cmd))
        row.injected = first.rc == 0
        row.wall_s += first.wall_s
        p = run(cmd, out.parent / f"{out.name}.log", self.bound_s)
        row.wall_s += p.wall_s
        refused = (p.rc not in (0, None) and not p.timed_out and "builtin:gpt" in p.stderr
                   and "builtin:llama" in p.stderr and "written for model" in p.stderr)
        row.recovered = refused
        row.data_lost = 0 if not (out / "model.safetensors").exists() else None
        row.extra["message"] = next((line for line in p.stderr.splitlines() if "written for model" in line), "")[:600]
        row.note = "refused (expected): " + row.extra["message"][:200] if refused else \
            f"NOT refused clearly: exit {p.rc}: {_tail(p.stderr, 4)}"
        self.add(row)
        return row

    def plan_cache(self, tamper: bool) -> Row:
        """A 4->3 run (caches world-3 programs), then --resume --steps 12 at --nproc 3:4 losing a node again: the
        cached entry is reused -- unless its key was edited to another cluster's (``tamper``)."""
        ref = self.ref(4, STEPS)
        out = self.dir(f"plan-cache-{'other' if tamper else 'same'}-cluster")
        env = {"ADAPTDIST_INJECT_FAULT": "lose-node:3:3"}
        first_cmd = _cmd(out, 6, "3:4", "--max-restarts", "2")
        first = run(first_cmd, out.parent / f"{out.name}.first.log", self.bound_s, env)
        env = {"ADAPTDIST_INJECT_FAULT": "lose-node:3:9"}  # in the resumed run (steps 7-12)
        entries = sorted((out / "programs_cache").glob("world3-*"))
        row = Row("plan-cache", ("entry keyed to another cluster" if tamper else "entry of this cluster") + ", 4->3",
                  "4->3")
        row.injected = first.rc == 0 and bool(entries)
        row.wall_s += first.wall_s
        if tamper and entries:
            kf = entries[0] / "cache_key.json"
            key = json.loads(kf.read_text())
            key["cluster"] = "another-cluster:" + str(key["cluster"])[::-1]
            kf.write_text(json.dumps(key, sort_keys=True))
        (out / "fault.json").unlink(missing_ok=True)
        # --resume restores neither --max-restarts nor --collective-timeout-s: give them again
        cmd = [sys.executable, "-m", "adaptdist.cli", "train", "--resume", str(out), "--steps", str(STEPS),
               "--max-restarts", "2"]
        row.command = _env_cmd(env, first_cmd) + (" ; edit the key" if tamper else "") + " ; " + _env_cmd(env, cmd)
        p = run(cmd, out.parent / f"{out.name}.log", self.bound_s, env)
        fault = _fault_file(out)
        finish_row(row, out, p, STEPS, ref, False, fault["time_s"] if fault else None)
        reused = "reusing the programs planned" in p.stderr
        row.extra["reused"] = reused
        if reused == tamper:
            row.recovered = False
            row.note = "; ".join(filter(None, [row.note, "REUSED an entry of another cluster" if tamper else
                                               "did not reuse its own cache entry"]))
        else:
            row.note = "; ".join(filter(None, [row.note, "reused" if reused else "re-planned, not reused"]))
        if "resumed_from_step" in row.extra:
            row.steps_redone = 8 - row.extra["resumed_from_step"]  # the fault came before step 9
        self.add(row)
        return row


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _env_cmd(env: dict, cmd: list[str]) -> str:
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd])


def _proc_start_time() -> float:
    """This process's start, seconds since the epoch (from /proc: its start in clock ticks since boot)."""
    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def anatomy_worker(cfg: dict) -> dict:
    """One rank of a restart, phase by phase, as ``runtime.worker.run_worker`` does it (times since the epoch)."""
    t = {"process_start": _proc_start_time(), "fn_entry": time.time()}
    import torch
    import torch.distributed as dist

    from adaptdist.program import load_program
    from adaptdist.runtime.checkpoint_store import latest_good
    from adaptdist.runtime.train_state import check_identical_replicas, load_train_state
    from adaptdist.runtime.worker import StepRunner, _init_distributed, global_batches, register_mesh_groups

    t["imports"] = time.time()
    cfg_t = cfg["train_config"]
    torch.set_num_threads(1)
    rank, world = _init_distributed(cfg_t)
    t["init_process_group"] = time.time()
    program = load_program(cfg["program_dir"], rank, world_size=world)
    t["load_program"] = time.time()
    mesh = register_mesh_groups(program, "gloo")
    runner = StepRunner(program, "sgd", 0.05)
    t["mesh_and_optimizer"] = time.time()
    info = latest_good(Path(cfg["checkpoints"]))
    t["verify_checkpoint"] = time.time()
    load_train_state(info.path, program, runner.state, runner.opt, mesh, rank, restore_rng=True, verify=False)
    check_identical_replicas(program, runner.state, runner.opt, mesh)
    t["load_checkpoint"] = time.time()
    runner.step(next(global_batches(cfg_t.data)))
    t["first_step"] = time.time()
    runner.step(next(global_batches(cfg_t.data)))
    t["second_step"] = time.time()
    dist.destroy_process_group()
    return t


def anatomy(ref: Path, reps: int = 3) -> dict:
    """What a restart on 2 ranks spends its time on: a fresh 2-rank ``launch_local`` (torch's agent, spawn) that
    does what a restarted rank does, on the reference run's programs and newest checkpoint; medians over ``reps``
    of the slowest rank's phase durations (s). Also ``python -c 'import torch'`` alone."""
    import pickle
    import statistics

    from adaptdist.runtime.launch import launch_local

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    import bench_faults

    cfg_t = pickle.loads((ref / "train_config.pkl").read_bytes()) if (ref / "train_config.pkl").is_file() else None
    if cfg_t is None:
        from adaptdist.runtime.worker import DataSpec, TrainConfig
        from adaptdist.model_spec import ModelSpec

        spec = ModelSpec.parse("builtin:gpt")
        cfg_t = TrainConfig(program_dir=str(ref / "programs"), out_dir=str(ref), steps=1, lr=0.05, timeout_s=120,
                            data=DataSpec(str(spec.file), "data", 4, 16, seed=0))
    phases = ["spawn (agent + process start)", "interpreter + torch import", "adaptdist imports",
              "init_process_group", "load_program", "mesh + optimizer", "verify checkpoint (sha256)",
              "load checkpoint (DCP) + replica check", "first step", "second step"]
    keys = ["process_start", "fn_entry", "imports", "init_process_group", "load_program", "mesh_and_optimizer",
            "verify_checkpoint", "load_checkpoint", "first_step", "second_step"]
    runs = []
    for _ in range(reps):
        t0 = time.time()
        res = launch_local(bench_faults.anatomy_worker, ({"train_config": cfg_t, "program_dir": str(ref / "programs"),
                                                          "checkpoints": str(ref / "checkpoints")},), 2)
        t1 = time.time()
        durs = {}
        for i, (name, key) in enumerate(zip(phases, keys)):
            prev = [t0] * len(res) if i == 0 else [r[keys[i - 1]] for r in res.values()]
            durs[name] = max(r[key] - p for r, p in zip(res.values(), prev))
        durs["agent exit"] = t1 - max(r["second_step"] for r in res.values())
        durs["total"] = t1 - t0
        runs.append(durs)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, adaptdist.runtime.worker, torch.distributed.checkpoint"],
                   check=True)
    all_import = time.perf_counter() - t0
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["python -c 'import torch' (one process, alone)"] = torch_import
    out["python -c 'import torch, adaptdist.runtime.worker, DCP' (alone)"] = all_import
    return out


def plan_rows(seeds: int, quick: bool, rng: random.Random) -> list[tuple]:
    """(method, args) of every fault to inject, in order."""
    n_small = 1 if quick else max(1, seeds // 2)
    n_scale = 1 if quick else max(1, (seeds + 2) // 3)
    todo: list[tuple] = []
    for kind in ("kill", "raise"):
        for _ in range(1 if quick else seeds):
            world = rng.choice([2, 2, 3, 4])
            todo.append(("injected", kind, world, rng.randrange(world), rng.randint(2, STEPS)))
    for _ in range(n_small):
        world = rng.choice([2, 3])
        todo.append(("injected", "stall", world, rng.randrange(world), rng.randint(2, STEPS),
                     "--collective-timeout-s", "5"))
    for _ in range(n_small):
        world = rng.choice([2, 3])
        todo.append(("injected", "term", world, rng.randrange(world), rng.randint(2, STEPS)))
    for _ in range(n_small):
        todo.append(("launcher_term", 2, round(rng.uniform(0.5, 3.0), 1)))
    for lost in (1, 2):
        for _ in range(n_scale):
            todo.append(("scale_down", lost, rng.randrange(4), rng.randint(3, STEPS)))
    for _ in range(n_scale):
        todo.append(("scale_up", rng.choice([2, 4, 6])))
    for plan in ("dp", "fsdp"):
        for k in ((3,) if quick else (3, 6, 1)):
            todo.append(("reshard", plan, k))
    for which in (("largest file",) if quick else ("largest file", "an RNG file")):
        todo.append(("truncated", which))
    todo.append(("other_model",))
    todo.append(("plan_cache", False))
    todo.append(("plan_cache", True))
    return todo


def table(rows: list[Row], title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in ("#", "fault", "detail", "ranks", "injected", "recovered", "redone", "fault->resumed step (s)",
              "failure recorded / restart event / +resume / +1st step (s)", "data lost", "params = ref", "max |diff|", "wall (s)", "note"):
        t.add_column(c, overflow="fold")

    def s(v):
        return "-" if v is None else f"{v:.1f}"

    for i, r in enumerate(rows, 1):
        t.add_row(str(i), r.fault, r.detail, r.world, "yes" if r.injected else "NO",
                  "yes" if r.recovered else "NO", "-" if r.steps_redone is None else str(r.steps_redone),
                  s(r.fault_to_resumed_s), f"{s(r.detected_s)} / {s(r.to_restart_s)} / +{s(r.restart_to_resume_s)} / +{s(r.resume_to_step_s)}",
                  "-" if r.data_lost is None else str(r.data_lost),
                  "-" if r.params_equal is None else ("yes" if r.params_equal else "NO"),
                  "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}", f"{r.wall_s:.0f}", r.note[:100])
    return t


def totals(rows: list[Row]) -> dict:
    import statistics

    def med(xs):
        xs = [x for x in xs if x is not None]
        return (statistics.median(xs), min(xs), max(xs), len(xs)) if xs else None

    by: dict[str, dict] = {}
    for r in rows:
        d = by.setdefault(r.fault, {"n": 0, "injected": 0, "recovered": 0, "lost": 0, "params_equal": 0,
                                    "t": [], "detected": [], "restart": [], "resume": [], "step": [], "t_2ranks": []})
        d["n"] += 1
        d["injected"] += r.injected
        d["recovered"] += r.recovered
        d["lost"] += r.data_lost or 0
        d["params_equal"] += bool(r.params_equal) or (r.params_equal is None and r.recovered)
        d["t"].append(r.fault_to_resumed_s)
        d["detected"].append(r.detected_s)
        d["restart"].append(r.to_restart_s)
        d["resume"].append(r.restart_to_resume_s)
        d["step"].append(r.resume_to_step_s)
        if r.world == "2":
            d["t_2ranks"].append(r.fault_to_resumed_s)
    out = {}
    for k, d in by.items():
        out[k] = {**{x: d[x] for x in ("n", "injected", "recovered", "lost", "params_equal")},
                  "fault_to_resumed_s": med(d["t"]), "fault_to_resumed_s_2ranks": med(d["t_2ranks"]),
                  "detected_s": med(d["detected"]),
                  "to_restart_s": med(d["restart"]), "restart_to_resume_s": med(d["resume"]),
                  "resume_to_step_s": med(d["step"])}
    out["all"] = {"n": len(rows), "injected": sum(r.injected for r in rows),
                  "recovered": sum(r.recovered for r in rows), "lost": sum(r.data_lost or 0 for r in rows),
                  "params_equal": sum(v["params_equal"] for v in out.values())}
    return out


def _anatomy_table(d: dict):
    from rich.table import Table

    t = Table(title="a restart on 2 ranks, phase by phase (median of 3, slowest rank)")
    t.add_column("phase")
    t.add_column("s", justify="right")
    for k, v in d.items():
        t.add_row(k, f"{v:.2f}")
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one fault of each kind (about 20 runs)")
    ap.add_argument("--seeds", type=int, default=10, help="faults of each random kind (kill, raise: N; stall, "
                    "term, launcher-term: N/2; each scale: N/3) (default 10: 55 faults)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random ranks and steps")
    ap.add_argument("--out", default=None, help="where runs and bench_faults.json go (default a temporary dir)")
    ap.add_argument("--only", default=None, help="comma-separated methods to run (injected, launcher_term, "
                    "scale_down, scale_up, reshard, truncated, other_model, plan_cache)")
    ap.add_argument("--no-anatomy", dest="anatomy", action="store_false",
                    help="skip the phase-by-phase timing of a 2-rank restart")
    ap.add_argument("--bound-s", type=float, default=300.0, help="wall-clock bound of each run (default 300)")
    ap.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                    help="run nothing: print the tables of the rows in DIR/bench_faults.json of each DIR (parts of "
                         "one run, e.g. two --only halves run side by side) and write them together into --out")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_faults_"))
    root.mkdir(parents=True, exist_ok=True)
    from rich.console import Console

    console = Console(width=250)
    if args.merge:
        return merge([Path(d) for d in args.merge], root, console)
    todo = plan_rows(args.seeds, args.quick, random.Random(args.seed))
    if args.only:
        keep = set(args.only.split(","))
        todo = [t for t in todo if t[0] in keep]
    load0 = os.getloadavg()
    t_start = time.time()
    print(f"bench_faults: {len(todo)} faults into {root}; load average {load0[0]:.2f}, {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", flush=True)
    bench = Bench(root, args.bound_s)
    loads = []
    if args.anatomy:
        ref = bench.ref(2, STEPS)
        bench.anatomy = anatomy(ref)
        console.print(_anatomy_table(bench.anatomy))
    for method, *a in todo:
        loads.append(os.getloadavg()[0])
        try:
            getattr(bench, method)(*a)
        except Exception as e:  # a benchmark bug must not lose the rows so far
            bench.add(Row(method, " ".join(map(str, a)), "?", note=f"benchmark error: {type(e).__name__}: {e}"))
        _write(root, bench, args, t_start, load0, loads)
    load1 = os.getloadavg()
    a = print_tables(console, bench.rows, bench.anatomy)
    print(f"load average {load0[0]:.2f} -> {load1[0]:.2f} (1-min; median during the runs "
          f"{sorted(loads)[len(loads) // 2]:.2f}); {time.time() - t_start:.0f} s in all; rows: "
          f"{root / 'bench_faults.json'}", flush=True)
    _write(root, bench, args, t_start, load0, loads)
    return 0 if a["recovered"] == a["n"] and a["lost"] == 0 else 1


def merge(dirs: list[Path], root: Path, console) -> int:
    """``--merge``: the rows of several parts of one run, as one table and one JSON file."""
    rows, anatomy_s, parts = [], {}, []
    for d in dirs:
        doc = json.loads((d / "bench_faults.json").read_text())
        rows += [Row(**r) for r in doc["rows"]]
        anatomy_s = anatomy_s or doc.get("anatomy_s") or {}
        parts.append({k: doc.get(k) for k in ("started", "args", "cores", "load_start", "loads")})
    a = print_tables(console, rows, anatomy_s)
    doc = {"parts": parts, "rows": [asdict(r) for r in rows], "totals": totals(rows), "anatomy_s": anatomy_s}
    (root / "bench_faults.json").write_text(json.dumps(doc, indent=1, default=str))
    (root / "bench_faults.md").write_text(markdown(rows, anatomy_s))
    loads = sorted(x for p in parts for x in (p["loads"] or []))
    if loads:
        print(f"load average during the runs (1-min, at each fault): median {loads[len(loads) // 2]:.2f}, "
              f"{loads[0]:.2f}-{loads[-1]:.2f}; rows: {root / 'bench_faults.json'}")
    return 0 if a["recovered"] == a["n"] and a["lost"] == 0 else 1


def markdown(rows: list[Row], anatomy_s: dict) -> str:
    """The rows, the totals and the restart anatomy as Markdown tables (for benchmarks/RESULTS.md)."""
    def s(v):
        return "-" if v is None else f"{v:.1f}"

    yn = {True: "yes", False: "**NO**", None: "-"}
    out = ["| # | fault | detail | ranks | injected | recovered | redone | fault->resumed step (s) | failure recorded / "
           "restart event / +resume / +1st step (s) | data lost | params = ref | max abs diff | note |",
           "|---:|---|---|---|---|---|---:|---:|---|---:|---|---:|---|"]
    for i, r in enumerate(rows, 1):
        note = r.note.replace("|", "/")
        out.append(f"| {i} | {r.fault} | {r.detail} | {r.world} | {yn[r.injected]} | {yn[r.recovered]} | "
                   f"{'-' if r.steps_redone is None else r.steps_redone} | {s(r.fault_to_resumed_s)} | "
                   f"{s(r.detected_s)} / {s(r.to_restart_s)} / +{s(r.restart_to_resume_s)} / +{s(r.resume_to_step_s)} | "
                   f"{'-' if r.data_lost is None else r.data_lost} | {yn[r.params_equal]} | "
                   f"{'-' if r.max_abs_diff is None else f'{r.max_abs_diff:.1e}'} | {note[:140]} |")
    tot = totals(rows)

    def m(v):
        return "-" if v is None else f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"

    out += ["", "| fault | n | injected | recovered | data lost | params = ref | fault->resumed step (s): median (min-max) "
            "| on 2 ranks | failure recorded | restart event | restart->resume | 1st step |",
            "|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|"]
    for k, v in tot.items():
        if k != "all":
            out.append(f"| {k} | {v['n']} | {v['injected']} | {v['recovered']} | {v['lost']} | {v['params_equal']} | "
                       f"{m(v['fault_to_resumed_s'])} | {m(v['fault_to_resumed_s_2ranks'])} | {m(v['detected_s'])} | "
                       f"{m(v['to_restart_s'])} | {m(v['restart_to_resume_s'])} | {m(v['resume_to_step_s'])} |")
    a = tot["all"]
    out.append(f"| **all** | {a['n']} | {a['injected']} | {a['recovered']} | {a['lost']} | {a['params_equal']} | | | | | | |")
    if anatomy_s:
        out += ["", "| a 2-rank restart, phase by phase (median of 3, slowest rank) | s |", "|---|---:|"]
        out += [f"| {k} | {v:.2f} |" for k, v in anatomy_s.items()]
    return "\n".join(out) + "\n"


def print_tables(console, rows: list[Row], anatomy_s: dict) -> dict:
    """Print the rows, the totals and the restart anatomy; returns the totals of all rows."""
    console.print(table(rows, f"bench_faults: {len(rows)} faults"))
    tot = totals(rows)
    from rich.table import Table

    t = Table(title="totals")
    for c in ("fault", "n", "injected", "recovered", "data lost", "params = ref", "fault->resumed step s: median "
              "(min-max)", "on 2 ranks", "failure recorded", "restart event", "restart->resume", "1st step"):
        t.add_column(c)

    def m(v):
        return "-" if v is None else f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"

    for k, v in tot.items():
        if k == "all":
            continue
        t.add_row(k, str(v["n"]), str(v["injected"]), str(v["recovered"]), str(v["lost"]), str(v["params_equal"]),
                  m(v["fault_to_resumed_s"]), m(v["fault_to_resumed_s_2ranks"]), m(v["detected_s"]), m(v["to_restart_s"]),
                  m(v["restart_to_resume_s"]), m(v["resume_to_step_s"]))
    a = tot["all"]
    t.add_row("all", str(a["n"]), str(a["injected"]), str(a["recovered"]), str(a["lost"]), str(a["params_equal"]))
    console.print(t)
    if anatomy_s:
        console.print(_anatomy_table(anatomy_s))
    return a


def _write(root: Path, bench: Bench, args, t_start: float, load0, loads) -> None:
    doc = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)), "args": vars(args),
           "cores": os.cpu_count(), "load_start": load0, "loads": loads, "rows": [asdict(r) for r in bench.rows],
           "totals": totals(bench.rows) if bench.rows else {},
           "anatomy_s": bench.anatomy}
    tmp = root / "bench_faults.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(root / "bench_faults.json")
    (root / "bench_faults.md").write_text(markdown(bench.rows, bench.anatomy))


if __name__ == "__main__":
    sys.exit(main())
