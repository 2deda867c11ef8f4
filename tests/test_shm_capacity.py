"""Shared-memory groups on a small /dev/shm (Docker's default is 64 MiB, shared by every group and job): a page of a
segment touched past the tmpfs's space would raise SIGBUS and kill the rank. The kernels reserve (fallocate) before
they touch: a group whose header and slots do not fit is a ShmCapacityError on every rank; the shared output and
registered input regions are reserved as used and, without room, all_reduce and the fused flatten fall back to
private memory (the same results), and ``input_buffer`` raises ShmCapacityError. ``--comm auto`` puts an axis whose
groups do not fit on gloo with one warning.

Each test runs its ranks in a private mount namespace with a small tmpfs on /dev/shm (``unshare``, as root); they
are skipped where that is not permitted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import adaptdist.kernels as kernels

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"shm kernels not built: {kernels.load_error()}")


def _namespace_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if proc.returncode != 0:
        return f"a private mount namespace with a tmpfs on /dev/shm is not permitted here: {proc.stderr.strip()}"
    return None


_REASON = _namespace_reason()
needs_namespace = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _run_small_shm(size_mib: int, argv: list[str], timeout_s: float = 240):
    """Run ``python argv...`` with /dev/shm a tmpfs of ``size_mib`` MiB (private to it and its children)."""
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec "$@"', "sh", sys.executable, *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(ROOT))


_RANKS_SCRIPT = textwrap.dedent(r"""
    import json, os, signal, subprocess, sys
    from pathlib import Path

    def rank_main(rank, store):
        import torch, torch.distributed as dist
        from adaptdist.errors import ShmCapacityError
        from adaptdist.kernels import shm
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
        out = {"rank": rank, "free_before": os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize}
        try:
            g = shm.init_group(dist.group.WORLD, name="cap", timeout_s=60)
        except ShmCapacityError as e:
            out["create_error"] = {"type": type(e).__name__, "msg": str(e), "group": e.group,
                                   "needed": e.needed_bytes}
            dist.destroy_process_group()  # (a live gloo group at exit may abort the interpreter's teardown)
            print("RESULT " + json.dumps(out), flush=True)
            return
        out["slot_bytes"] = g.slot_bytes
        ops = torch.ops.adaptdist
        n = 4 << 20  # 16 MiB of float32
        x = torch.arange(n, dtype=torch.float32) * (rank + 1) / n
        want = torch.arange(n, dtype=torch.float32) * 3 / n
        y = g.all_reduce(x)
        out["all_reduce_equal"] = bool(torch.equal(y, want))
        y2 = g.all_reduce(x)  # again (the failed reservation is not retried at once)
        out["all_reduce_again_equal"] = bool(torch.equal(y2, want))
        del y, y2
        parts = [x[: n // 2].reshape(1024, -1), x[n // 2:]]
        z = ops.shm_wait(ops.shm_flatten_all_reduce_start(parts, 0, "sum", "cap"))
        out["flatten_equal"] = bool(torch.equal(z, want))
        del z
        a = g.all_gather(torch.full((1 << 20,), float(rank)))  # a slot's worth: every slot byte is reserved
        out["all_gather_ok"] = bool(torch.equal(a[: 1 << 20], torch.zeros(1 << 20))
                                    and torch.equal(a[1 << 20:], torch.ones(1 << 20)))
        try:
            g.input_buffer(n)
            out["input_buffer_error"] = None
        except ShmCapacityError as e:
            out["input_buffer_error"] = {"type": type(e).__name__, "msg": str(e), "group": e.group}
        small = g.input_buffer(1 << 16)  # 256 KiB fits: filled and reduced in place
        small.copy_(x[: 1 << 16])
        r = g.all_reduce(small)
        out["small_registered_equal"] = bool(torch.equal(r, want[: 1 << 16]))
        del r, small
        dist.barrier()
        g.destroy()
        dist.destroy_process_group()
        print("RESULT " + json.dumps(out), flush=True)

    if __name__ == "__main__":
        if len(sys.argv) > 2:
            rank_main(int(sys.argv[1]), sys.argv[2])
            sys.exit(0)
        work = Path(sys.argv[1])
        store = str(work / "store")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), store], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        results = []
        for p in procs:
            so, se = p.communicate(timeout=180)
            res = json.loads(so.split("RESULT ", 1)[1]) if "RESULT " in so else None
            results.append({"returncode": p.returncode, "result": res, "stderr": se[-3000:]})
        left = [e.name for e in Path("/dev/shm").iterdir() if e.name.startswith("adaptdist-")]
        print("SUMMARY " + json.dumps({"ranks": results, "left": left}))
""")


def _ranks(tmp_path, size_mib: int):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_SCRIPT)
    proc = _run_small_shm(size_mib, [str(script), str(tmp_path)])
    assert "SUMMARY " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    for r in summary["ranks"]:
        assert r["returncode"] == 0, r  # never killed by a signal (SIGBUS: -7)
        assert r["result"] is not None, r
    assert summary["left"] == []  # the segment is gone (and its reservation with it)
    return [r["result"] for r in summary["ranks"]]


@needs_namespace
def test_group_without_room_for_its_slots_is_a_typed_error_on_every_rank(tmp_path):
    """/dev/shm of 8 MiB, 2 ranks (header and the smallest slots: 10 MiB): ShmCapacityError naming the group,
    /dev/shm's size and free bytes, the bytes needed and what to try, on both ranks; no crash, no segment left."""
    for res in _ranks(tmp_path, 8):
        err = res["create_error"]
        assert err["type"] == "ShmCapacityError" and err["group"] == "cap"
        assert err["needed"] >= 10 << 20
        msg = err["msg"]
        assert "/dev/shm (" in msg and str(8 << 20) in msg and "free" in msg
        assert str(err["needed"]) in msg and "--comm gloo" in msg and "--shm-size" in msg


@needs_namespace
@pytest.mark.parametrize("size_mib,slot_mib", [(20, 1), (36, 1)])
def test_room_for_the_slots_only_falls_back_with_equal_results(tmp_path, size_mib, slot_mib):
    """/dev/shm of 20 or 36 MiB, 2 ranks: the group is made with 1 MiB slots (10 MiB reserved). Then a 16 MiB
    all_reduce (no room for its shared output; on 36 MiB, room for one rank's only) and the fused flatten of a 16 MiB
    bucket (no room in the input region) fall back and equal the sum; an input_buffer of 16 MiB is a
    ShmCapacityError, one of 256 KiB works in place."""
    for res in _ranks(tmp_path, size_mib):
        assert "create_error" not in res, res
        assert res["slot_bytes"] == slot_mib << 20, res
        assert res["all_reduce_equal"] and res["all_reduce_again_equal"], res
        assert res["flatten_equal"] and res["all_gather_ok"], res
        err = res["input_buffer_error"]
        assert err is not None and err["type"] == "ShmCapacityError" and err["group"] == "cap", res
        assert "/dev/shm (" in err["msg"] and "--shm-size" in err["msg"]
        assert res["small_registered_equal"], res


def _train(tmp_path, size_mib: int, comm: str = "auto", ok: bool = True):
    out = tmp_path / "o"
    code = ("import sys; from adaptdist.cli import main; sys.exit(main(['train', 'tests/models.py:wide_mlp', "
            f"'--nproc', '2', '--batch-size', '8', '--plan', 'dp', '--comm', {comm!r}, '--sample-bytes', '0', "
            f"'--out', {str(out)!r}, '--steps', '3', '--optimizer', 'sgd', '--lr', '2e-3']))")
    proc = _run_small_shm(size_mib, ["-c", code], timeout_s=600)
    if not ok:
        return None, proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "summary.json").read_text()), proc


@pytest.mark.slow
@needs_namespace
@pytest.mark.parametrize("size_mib,transport", [(24, "shm"), (8, "gloo")])
def test_train_comm_auto_on_small_dev_shm_equals_eager(tmp_path, size_mib, transport):
    """`adaptdist train --comm auto` on a 24 MiB /dev/shm: shared memory (1 MiB slots; its buckets partly fall back to
    private memory); on 8 MiB: gloo, with one warning saying why. Eager's losses either way."""
    from tests.test_comm_shm import LR, STEPS, _eager

    assert STEPS == 3 and LR == 2e-3
    want_losses, _ = _eager(ROOT / "tests" / "models.py", "wide_mlp")
    summary, proc = _train(tmp_path, size_mib)
    assert summary["transports"] == {"dp": transport}
    # the programs say they were lowered under --comm auto (a group not made at the start then falls back to gloo)
    assert json.loads((tmp_path / "o" / "programs" / "rank0" / "program.json").read_text())["comm"] == "auto"
    assert summary["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    warned = (proc.stdout + proc.stderr).count("/dev/shm has")
    assert warned == (1 if transport == "gloo" else 0), proc.stderr[-3000:]


@pytest.mark.slow
@needs_namespace
def test_train_comm_shm_on_too_small_dev_shm_is_a_typed_error():
    """`--comm shm` (explicit) on an 8 MiB /dev/shm: the run stops with ShmCapacityError naming the group, /dev/shm's
    size and what to try; no traceback, no rank killed by a signal."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        _, proc = _train(Path(d), 8, comm="shm", ok=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode > 0, text[-3000:]
    assert "ShmCapacityError" in text and "adaptdist:dp[0,1]" in text and str(8 << 20) in text, text[-3000:]
    assert "--shm-size" in text and "Traceback" not in text, text[-3000:]
    assert "SIGBUS" not in text and "signal" not in text, text[-3000:]


def test_comm_auto_keeps_axes_on_shm_while_their_groups_fit_dev_shm(caplog):
    """fit_shm_space: dp=2,tp=2 needs 2 groups of 2 ranks per axis (about 20 MiB of the smallest slots); with room for
    one axis the first stays on shm and the second goes to gloo with one warning naming it, /dev/shm's free bytes
    and what to try; with room for none, both; unreadable space changes nothing."""
    import logging

    from adaptdist.comm_transport import fit_shm_space
    from adaptdist.kernels.shm import MIN_SLOT_BYTES, segment_fixed_bytes
    from adaptdist.mesh import Mesh

    mesh = Mesh.parse("dp=2,tp=2")
    both = {"dp": "shm", "tp": "shm"}
    per_axis = 2 * segment_fixed_bytes(2, MIN_SLOT_BYTES)
    assert per_axis >= 20 << 20
    with caplog.at_level(logging.WARNING, logger="adaptdist.compiler"):
        assert fit_shm_space(mesh, both, space=(1 << 30, 3 * per_axis)) == both
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="adaptdist.compiler"):
        assert fit_shm_space(mesh, both, space=(64 << 20, per_axis + 1)) == {"dp": "shm", "tp": "gloo"}
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "'tp'" in msg and "'dp'" not in msg and str(per_axis + 1) in msg and "--shm-size" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adaptdist.compiler"):
        assert fit_shm_space(mesh, both, space=(64 << 20, per_axis - 1)) == {"dp": "gloo", "tp": "gloo"}
    assert len(caplog.records) == 1
    assert fit_shm_space(mesh, {"dp": "gloo", "tp": "none"}, space=(0, 0)) == {"dp": "gloo", "tp": "none"}
    # the pipeline's all-or-nothing check: room for two groups of 2 ranks, not three
    from adaptdist.comm_transport import shm_space_fits

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adaptdist.compiler"):
        assert shm_space_fits([2, 2], "the pipeline's 2 groups", space=(1 << 30, per_axis))
        assert not shm_space_fits([2, 2, 2], "the pipeline's 3 groups", space=(1 << 30, per_axis))
    assert len(caplog.records) == 1 and "the pipeline's 3 groups" in caplog.records[0].getMessage()


def test_default_slot_halves_to_fit_dev_shm():
    """The default 4 MiB slot halves (to 1 MiB at least) until a group's slots take at most a quarter of /dev/shm's
    free bytes, leaving room for the groups made after it."""
    from adaptdist.kernels.shm import DEFAULT_SLOT_BYTES, MIN_SLOT_BYTES, fitting_slot_bytes

    assert fitting_slot_bytes(2, space=(1 << 30, 1 << 30)) == DEFAULT_SLOT_BYTES
    assert fitting_slot_bytes(2, space=(200 << 20, 100 << 20)) == 2 << 20  # 20 MiB of slots <= 25 MiB
    assert fitting_slot_bytes(4, space=(64 << 20, 64 << 20)) == MIN_SLOT_BYTES  # Docker's default: 20 MiB of slots
    assert fitting_slot_bytes(2, space=(8 << 20, 8 << 20)) == MIN_SLOT_BYTES  # too small even so: init_group raises


def _rank_hosts_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import adaptdist.kernels.shm as kshm
    from adaptdist.compiler import dynamo_backend

    # rank 1 reads /dev/shm later, after its peers made their groups: it would see less room
    kshm.shm_space = (lambda: (64 << 20, 1 << 20)) if rank == 1 else (lambda: (64 << 20, 60 << 20))
    hosts, comm, space = dynamo_backend._rank_hosts("auto", rank, dist.group.WORLD)
    return {"hosts": list(hosts), "comm": comm, "space": list(space)}


@pytest.mark.timeout(120)
def test_backend_ranks_fit_dev_shm_with_rank_0s_reading():
    """The backend lowers on every rank: `--comm auto` fits the groups into rank 0's reading of /dev/shm, agreed by
    every rank, not each rank's own (one reading after its peers made their groups chose gloo for an axis they put on
    shared memory: a hang)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from shm_workers import run_ranks

    res = run_ranks(_rank_hosts_worker, 2, timeout_s=100)
    assert res[0]["space"] == res[1]["space"] == [64 << 20, 60 << 20], res
    assert res[0]["comm"] == res[1]["comm"] == "auto" and res[0]["hosts"] == res[1]["hosts"], res


def test_comm_auto_counts_the_slots_creation_will_take():
    """With room for every group at the smallest slots, the first groups made still take larger ones while /dev/shm
    is roomy (fitting_slot_bytes): dp=4,tp=4 (8 groups of 4 ranks) with a little more than 8 groups' smallest slots
    free does not fit both axes, so `--comm auto` keeps one on gloo rather than promising shared memory that the last
    group's creation refuses (ShmCapacityError)."""
    from adaptdist.comm_transport import fit_shm_space
    from adaptdist.kernels.shm import MIN_SLOT_BYTES, fitting_slot_bytes, groups_fixed_bytes, segment_fixed_bytes
    from adaptdist.mesh import Mesh

    mesh = Mesh.parse("dp=4,tp=4")
    smallest = 8 * segment_fixed_bytes(4, MIN_SLOT_BYTES)
    free = smallest + (1 << 20)
    assert fitting_slot_bytes(4, (0, free)) > MIN_SLOT_BYTES  # the first group's slots are larger
    assert groups_fixed_bytes([4] * 8, free) > free
    assert fit_shm_space(mesh, {"dp": "shm", "tp": "shm"}, space=(1 << 30, free)) == {"dp": "shm", "tp": "gloo"}
    # simulated creation in that order fits: what the kept axis takes is within the free bytes
    assert groups_fixed_bytes([4] * 4, free) <= free


def _partial_capacity_worker(rank: int, world: int) -> dict:
    """dp=2,tp=2 on 4 ranks: the shared-memory group of dp over ranks [1, 3] cannot be made (a ShmCapacityError as
    /dev/shm full at that moment makes it, on both of its ranks), the others can."""
    import torch.distributed as dist

    import adaptdist.kernels.shm as kshm
    from adaptdist.errors import ShmCapacityError
    from adaptdist.runtime import shm_groups

    real = kshm.init_group

    def init_group(pg, **kw):
        if kw.get("name") == "adaptdist:dp[1,3]":
            dist.barrier(group=pg)  # (as the real one: a collective of the group before it raises)
            raise ShmCapacityError("adaptdist shm: /dev/shm full", "adaptdist:dp[1,3]", 10 << 20)
        return real(pg, **kw)

    kshm.init_group = init_group
    groups = {"dp": dist.new_group([0, 2]), "dp1": dist.new_group([1, 3]),
              "tp": dist.new_group([0, 1]), "tp1": dist.new_group([2, 3])}
    mine = {"dp": groups["dp" if rank in (0, 2) else "dp1"], "tp": groups["tp" if rank in (0, 1) else "tp1"]}
    names = {"dp": "adaptdist:dp", "tp": "adaptdist:tp"}
    dp = "[0,2]" if rank in (0, 2) else "[1,3]"
    tp = "[0,1]" if rank in (0, 1) else "[2,3]"
    code = (f"x = torch.ops.adaptdist.shm_all_reduce.default(a, 'sum', 'adaptdist:dp{dp}')\n"
            f"y = torch.ops.adaptdist.shm_all_reduce.default(b, 'sum', 'adaptdist:tp{tp}')\n")
    made, gloo = shm_groups.setup_shm_groups_or_gloo(code, names, mine.__getitem__, 60, fall_back=True)
    out = {"made": made, "gloo": {a: [s.needed_bytes, s.free_bytes, s.size_bytes] for a, s in gloo.items()},
           "live": kshm.group_names()}
    for name in kshm.group_names():
        kshm.destroy_group(name)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_comm_auto_ranks_agree_to_put_an_axis_on_gloo_when_one_of_its_groups_cannot_be_made():
    """dp=2,tp=2: only the dp group of ranks 1 and 3 finds no room in /dev/shm. Under `--comm auto` every rank (0 and 2
    too, whose own dp group was made) puts dp on gloo and destroys its dp group; tp stays on shared memory."""
    sys.path.insert(0, str(Path(__file__).parent))
    from shm_workers import run_ranks

    res = run_ranks(_partial_capacity_worker, 4, timeout_s=200)
    assert sorted(res) == [0, 1, 2, 3], res
    for rank, r in res.items():
        assert "error" not in r, r
        tp = "[0,1]" if rank in (0, 1) else "[2,3]"
        assert r["gloo"].keys() == {"dp"} and r["gloo"]["dp"][0] == 10 << 20, r
        assert r["made"] == [f"adaptdist:tp{tp}"] and r["live"] == [f"adaptdist:tp{tp}"], r


def _run_cli(size_mib: int, argv: list[str]):
    code = f"import sys; from adaptdist.cli import main; sys.exit(main({argv!r}))"
    return _run_small_shm(size_mib, ["-c", code], timeout_s=600)


@pytest.mark.slow
@needs_namespace
@pytest.mark.timeout(900)
def test_run_of_comm_auto_artifacts_on_too_small_dev_shm_falls_back_to_gloo(tmp_path):
    """Artifacts compiled with `--comm auto` where /dev/shm had room (dp on shared memory), run where it has 8 MiB:
    the group cannot be made as the run starts, so both ranks put dp on gloo (one warning naming the axis, /dev/shm's
    free bytes and the bytes needed) and train bitwise as the artifacts compiled with `--comm gloo` do (the same
    collectives in the same order). Compiled with `--comm shm`, the same run stops with ShmCapacityError."""
    import torch
    from safetensors.torch import load_file

    common = ["tests/models.py:wide_mlp", "--nproc", "2", "--batch-size", "8", "--plan", "dp"]
    arts = {}
    for comm in ("auto", "gloo", "shm"):
        arts[comm] = tmp_path / f"art_{comm}"
        proc = _run_small_shm(1024, ["-m", "adaptdist.cli", "compile", *common, "--comm", comm, "-o", str(arts[comm])])
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((arts["auto"] / "manifest.json").read_text())["transports"] == {"dp": "shm"}
    steps = ["--steps", "3", "--optimizer", "sgd", "--lr", "2e-3"]
    runs = {}
    for comm in ("auto", "gloo"):
        out = tmp_path / f"run_{comm}"
        proc = _run_cli(8, ["run", str(arts[comm]), "--out", str(out), *steps])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        runs[comm] = (json.loads((out / "summary.json").read_text()), load_file(str(out / "model.safetensors")), proc)
    summary, params, proc = runs["auto"]
    text = proc.stdout + proc.stderr
    assert summary["transports"] == {"dp": "gloo"}
    assert text.count("--comm auto puts mesh axis 'dp' on gloo") == 1, text[-3000:]
    import re

    needed = re.search(r"bytes free of 8388608, the group needed (\d+)", text)
    assert needed and int(needed.group(1)) >= 10 << 20, text[-3000:]  # header and 2 ranks' smallest slots
    assert summary["losses"] == runs["gloo"][0]["losses"]  # bitwise: the same reductions in the same order
    assert params.keys() == runs["gloo"][1].keys()
    for name, p in params.items():
        assert torch.equal(p, runs["gloo"][1][name]), name
    proc = _run_cli(8, ["run", str(arts["shm"]), "--out", str(tmp_path / "run_shm"), *steps])
    text = proc.stdout + proc.stderr
    assert proc.returncode > 0 and "ShmCapacityError" in text and "adaptdist:dp[0,1]" in text, text[-3000:]
    assert "Traceback" not in text and "on gloo" not in text, text[-3000:]


_BACKEND_SCRIPT = textwrap.dedent(r"""
    import json, sys
    sys.path.insert(0, "tests")

    def worker(rank, world, comm):
        import torch, torch.nn as nn, torch.nn.functional as F
        import adaptdist
        from adaptdist.compiler import dynamo_backend
        from adaptdist.kernels import shm

        real = dynamo_backend._rank_hosts

        def roomy(*args, **kwargs):  # the lowering sees a roomy /dev/shm: as if it filled up right after
            hosts, mode, _space = real(*args, **kwargs)
            return hosts, mode, (1 << 30, 1 << 30)

        dynamo_backend._rank_hosts = roomy
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 4))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
        step = torch.compile(model, backend=adaptdist.backend(plan="dp", comm=comm), dynamic=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = F.cross_entropy(step(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "groups": shm.group_names()}

    if __name__ == "__main__":
        import torch
        from shm_workers import run_ranks
        out = {}
        for comm in ("auto", "gloo"):
            res = run_ranks(worker, 2, (comm,), timeout_s=240)
            out[comm] = {r: v if "error" in v else {"losses": v["losses"], "groups": v["groups"]}
                         for r, v in res.items()}
            if comm == "auto" and all("error" not in v for v in res.values()):
                auto = res
            elif comm == "gloo" and "auto" in dir():
                out["params_equal"] = [all(torch.equal(auto[r]["params"][n], res[r]["params"][n])
                                           for n in res[r]["params"]) for r in sorted(res)]
        print("SUMMARY " + json.dumps(out))
""")


@pytest.mark.slow
@needs_namespace
@pytest.mark.timeout(600)
def test_backend_comm_auto_falls_back_to_gloo_when_the_group_cannot_be_made(tmp_path):
    """torch.compile(backend=adaptdist.backend(comm="auto")), 2 ranks, dp: the lowering saw room in /dev/shm for dp's
    group, but /dev/shm (8 MiB) has none when the group is made: both ranks put dp on gloo (one warning) and train
    bitwise as comm="gloo" does (losses and SGD-updated parameters on each rank); no shared-memory group is left."""
    script = tmp_path / "backend_ranks.py"
    script.write_text(_BACKEND_SCRIPT)
    proc = _run_small_shm(8, [str(script)], timeout_s=560)
    assert "SUMMARY " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    for comm in ("auto", "gloo"):
        assert sorted(out[comm]) == ["0", "1"] and all("error" not in v for v in out[comm].values()), out
        assert all(v["groups"] == [] for v in out[comm].values()), out
    assert [out["auto"][r]["losses"] for r in "01"] == [out["gloo"][r]["losses"] for r in "01"]
    assert out["params_equal"] == [True, True], out
    text = proc.stdout + proc.stderr
    assert text.count("--comm auto puts mesh axis 'dp' on gloo") == 1, text[-3000:]
    assert "bytes free of 8388608, the group needed" in text, text[-3000:]


_REUSE_SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    sys.path.insert(0, "tests")

    def free():
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize

    def worker(rank, world):
        import gc
        import torch, torch.distributed as dist
        from adaptdist.kernels import shm
        out = {"free0": free(), "rounds": []}
        for i in range(5):
            g = shm.init_group(dist.group.WORLD, name=f"r{i}", timeout_s=60)
            x = torch.ones(1 << 20)  # 4 MiB: its output takes the shared output region (reserved as used)
            y = g.all_reduce(x)
            b = g.input_buffer(1 << 18)  # 1 MiB of the registered input region
            b.fill_(1.0)
            z = g.all_reduce(b)
            ok = bool(torch.equal(y, x * 2) and torch.equal(z, b * 2))
            dist.barrier()
            used = free()
            g.destroy()
            dist.barrier()
            kept = free()  # a tensor on the segment keeps it mapped: reserved still
            del y, z, b
            gc.collect()
            dist.barrier()
            out["rounds"].append({"ok": ok, "used": used, "kept": kept, "after": free(), "slot": g.slot_bytes})
        return out

    if __name__ == "__main__":
        from shm_workers import run_ranks
        res = run_ranks(worker, 2, timeout_s=200)
        print("SUMMARY " + json.dumps({str(r): v if "error" not in v else {"error": v["error"][-2000:]}
                                       for r, v in res.items()}))
""")


@pytest.mark.slow
@needs_namespace
@pytest.mark.timeout(300)
def test_destroyed_groups_give_their_reservations_back(tmp_path):
    """/dev/shm of 24 MiB, 2 ranks, five groups made, used and destroyed one after another: each reserves its header
    and slots and, as used, ranges of the shared output and registered input regions (more than half of /dev/shm in
    all); while a tensor on the segment lives (an all_reduce's output, an input_buffer) the reservation stays, and
    once the group is destroyed on every rank and those tensors are gone /dev/shm is as free as before, so the next
    group is made (not a ShmCapacityError)."""
    script = tmp_path / "reuse.py"
    script.write_text(_REUSE_SCRIPT)
    proc = _run_small_shm(24, [str(script)], timeout_s=280)
    assert "SUMMARY " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    assert sorted(out) == ["0", "1"], out
    for res in out.values():
        assert "error" not in res, res
        assert len(res["rounds"]) == 5, res
        for r in res["rounds"]:
            assert r["ok"], res
            assert res["free0"] - r["used"] >= 14 << 20, res  # slots and header (>10 MiB) and the used ranges
            assert r["kept"] <= r["used"] + (1 << 20), res  # tensors alive on the segment: still reserved
            assert r["after"] == res["free0"], res  # all given back


@pytest.mark.slow
@needs_namespace
@pytest.mark.timeout(900)
def test_run_of_comm_auto_pipeline_on_too_small_dev_shm_falls_back_to_gloo(tmp_path):
    """A pipeline (pp=2,tp=2, 4 ranks) compiled with `--comm auto` where /dev/shm had room (the stages' tp collectives
    on shared memory), run where it has 8 MiB: its groups cannot be made, so every rank puts all of them on gloo (all
    or nothing, as the lowering decides for pipelines; one warning) and trains bitwise as the `--comm gloo` artifacts."""
    import torch
    from safetensors.torch import load_file

    model_file = tmp_path / "m.py"  # tiny_gpt with the built-in GPT's TP_PLAN
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                          "from models import tiny_gpt  # noqa: F401\nfrom adaptdist.models.gpt import TP_PLAN  # noqa\n")
    common = [f"{model_file}:tiny_gpt", "--batch-size", "8", "--seq-len", "8", "--plan", "tp", "--mesh", "pp=2,tp=2",
              "--microbatches", "2", "--schedule", "gpipe"]
    runs = {}
    for comm in ("auto", "gloo"):
        art, out = tmp_path / f"art_{comm}", tmp_path / f"run_{comm}"
        proc = _run_small_shm(1024, ["-m", "adaptdist.cli", "compile", *common, "--comm", comm, "-o", str(art)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = _run_cli(8, ["run", str(art), "--out", str(out), "--steps", "2", "--optimizer", "sgd", "--lr", "0.1"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        runs[comm] = (json.loads((out / "summary.json").read_text()), load_file(str(out / "model.safetensors")), proc)
    assert json.loads((tmp_path / "art_auto" / "manifest.json").read_text())["transports"] == {"pp": "gloo", "tp": "shm"}
    summary, params, proc = runs["auto"]
    text = proc.stdout + proc.stderr
    assert summary["transports"] == {"pp": "gloo", "tp": "gloo"}
    assert text.count("--comm auto puts the pipeline's") == 1 and "bytes free of 8388608" in text, text[-3000:]
    assert summary["losses"] == runs["gloo"][0]["losses"]
    assert params.keys() == runs["gloo"][1].keys()
    for name, p in params.items():
        assert torch.equal(p, runs["gloo"][1][name]), name
