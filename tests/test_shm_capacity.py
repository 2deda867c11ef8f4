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
