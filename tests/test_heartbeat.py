"""Heartbeats in the store, and collective timeouts naming the rank that did not arrive."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from adaptdist.errors import CollectiveTimeoutError
from adaptdist.runtime.heartbeat import Heartbeat, is_collective_failure, named_timeout
from adaptdist.runtime.launch import host_loopback_store, launch_local
from adaptdist.runtime.timeouts import Timeouts

from launch_workers import stall_worker


def _store():
    return host_loopback_store(0, timeout_s=5)


def test_laggards_name_ranks_behind_with_step_and_age():
    store = _store()
    hbs = [Heartbeat(r, 3, store, collective_timeout_s=3) for r in range(3)]
    hbs[0].beat(5)
    hbs[1].beat(4)
    time.sleep(0.05)
    lags = hbs[0].laggards(5)
    assert [(lag.rank, lag.step) for lag in lags] == [(2, None), (1, 4)]
    assert lags[1].age_s is not None and 0.0 < lags[1].age_s < 5.0
    assert hbs[0].laggards(4) == [lags[0]]  # only rank 2, which never beat
    assert "rank 1 (last heartbeat at step 4" in lags[1].describe()


def test_named_timeout_names_the_rank_that_did_not_wait():
    store = _store()
    hbs = [Heartbeat(r, 3, store, collective_timeout_s=3) for r in range(3)]
    for hb in hbs:
        hb.beat(7)
    hbs[2].mark_waiting(7)  # rank 2 timed out too; rank 1 never reported
    err = named_timeout(RuntimeError("[pair.cc:534] Timed out waiting 3000ms for recv"), hbs[0], 7, settle_s=0.3)
    assert isinstance(err, CollectiveTimeoutError)
    msg = str(err)
    assert msg.startswith("rank 1 did not arrive at the collective of step 7"), msg
    assert "--collective-timeout-s 3" in msg and "rank 2" not in msg.split(";")[0]


def test_a_peer_the_shm_kernels_saw_die_is_named_dead_and_the_restart_blames_it(tmp_path):
    """The shm kernels notice a dead peer at once (its pid is gone): the error says it died, not that this rank
    waited out the timeout, and the restart line blames the dead rank (silent in its record), not the rank that
    noticed."""
    from adaptdist.errors import ShmPeerError
    from adaptdist.runtime.rank_status import RankStatus, failure_of

    hbs = [Heartbeat(r, 2, _store(), collective_timeout_s=120) for r in range(2)]
    hbs[0].beat(17)
    hbs[1].beat(17)
    shm = ShmPeerError("adaptdist shm: all_reduce on group 'adaptdist:dp[0,1]': peer group rank 1 (global rank 1, "
                       "pid 23971) died (its process is gone)", "adaptdist:dp[0,1]", 1, 1, 23971)
    err = named_timeout(shm, hbs[0], 17, settle_s=0.3)
    msg = str(err)
    assert isinstance(err, CollectiveTimeoutError)
    assert msg.startswith("rank 1 died at the collective of step 17 (its process is gone)"), msg
    assert "rank 0 noticed at once" in msg and "waited" not in msg
    # rank 1 was SIGKILLed mid-step (its record still says running); rank 0 recorded the error above
    RankStatus(tmp_path, 1, 0).update(step=17)
    RankStatus(tmp_path, 0, 0).update(state="failed", step=17, error=f"{type(err).__name__}: {err}",
                                      error_type=type(err).__name__)
    cause = failure_of(tmp_path, 0)
    assert cause is not None and cause.startswith("rank 1 (pid"), cause
    assert "died without a word after step 17" in cause


def test_named_timeout_leaves_other_errors_alone():
    hb = Heartbeat(0, 2, _store(), collective_timeout_s=3)
    e = ValueError("shape mismatch")
    assert named_timeout(e, hb, 1) is e
    assert is_collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_collective_failure(RuntimeError("size mismatch"))


def test_named_timeout_when_the_store_is_gone_names_rank_0():
    store = _store()
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=2))
    hb = Heartbeat(1, 2, client, collective_timeout_s=3)
    hb.beat(2)
    del store  # rank 0, the store's host, died
    time.sleep(0.2)
    err = named_timeout(RuntimeError("Connection closed by peer"), hb, 2, settle_s=0.5)
    assert str(err).startswith("rank 0 did not arrive at the collective of step 2"), str(err)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_stalled_rank_is_named_within_the_timeout_plus_a_few_seconds():
    timeouts = Timeouts.for_collective(3)
    out = launch_local(stall_worker, (1, 2, 7.0, 5), 2, timeouts=timeouts)
    r0 = out[0]
    assert r0["type"] == "CollectiveTimeoutError" and r0["step"] == 2, r0
    assert r0["error"].startswith("rank 1 did not arrive at the collective of step 2: rank 1 (last heartbeat "
                                  "at step 2"), r0["error"]
    assert "--collective-timeout-s 3" in r0["error"]
    print(f"rank 0 named rank 1 {r0['after_s']:.1f} s after entering the collective")
    assert 3.0 <= r0["after_s"] < 3.0 + 4.0, r0["after_s"]


def test_rank_status_notes_steps_at_most_every_interval(tmp_path, monkeypatch):
    """A running rank's record follows its steps (throttled), so a SIGKILLed rank is named at its last step,
    not at its last checkpoint."""
    import json

    from adaptdist.runtime import rank_status
    from adaptdist.runtime.rank_status import RankStatus, failure_of

    now = [1000.0]
    monkeypatch.setattr(rank_status.time, "time", lambda: now[0])
    st = RankStatus(tmp_path, 1, 0)
    assert not st.note_step(1)  # written at start, not yet a second old
    now[0] += rank_status.STATUS_EVERY_S
    assert st.note_step(2)
    assert not st.note_step(3)
    now[0] += 5.0
    assert st.note_step(59)
    assert json.loads(st.path.read_text())["step"] == 59
    assert "died without a word after step 59" in failure_of(tmp_path, 0)


# -- 2-D meshes: a survivor names the rank that died, not the live rank it waited on -----------------------------
# dp=2,tp=2 on 4 ranks: tp groups [0,1] and [2,3], dp groups [0,2] and [1,3]. Rank 1 is SIGKILLed at step 3: ranks 0
# (tp[0,1]) and 3 (dp[1,3]) see its process end at once; rank 2 is blocked in dp[0,2] waiting on rank 0, which is
# itself stuck on rank 1, and fails only when rank 0 exits (taking the store, which it hosts, with it).

_GONE_1 = ("adaptdist shm: all_reduce on group 'adaptdist:tp[0,1]' (2 ranks; this is group rank 0, global rank 0, "
           "pid 100): peer group rank 1 (global rank 1, pid 101) died (its process is gone)")
_GONE_0 = ("adaptdist shm: all_reduce on group 'adaptdist:dp[0,2]' (2 ranks; this is group rank 1, global rank 2, "
           "pid 102): peer group rank 0 (global rank 0, pid 100) died (its process is gone)")


def _records(**over):
    recs = {r: {"rank": r, "state": "running", "pid": 100 + r, "host": "h", "step": 2} for r in range(4)}
    for r, fields in over.items():
        recs[int(r[1:])].update(fields)
    return recs


def test_2d_rank_that_saw_the_death_names_it_and_not_the_rank_blocked_elsewhere():
    from adaptdist.runtime.heartbeat import compose_failure, own_failure, peer_states
    from adaptdist.errors import ShmPeerError

    own = own_failure(ShmPeerError(_GONE_1, "adaptdist:tp[0,1]", 1, 1, 101))
    assert (own.peer, own.group, own.lost) == (1, "tp[0,1]", True)
    now = 1000.0
    states = peer_states(0, 4, 3, own, waiting={3: (3, now - 0.1)}, beats={r: (3, now - 2.1) for r in range(4)},
                         records=_records(), store_read=True, now=now, host="h", alive=lambda pid: pid != 101)
    assert {r: st.kind for r, st in states.items()} == {1: "dead", 2: "silent", 3: "waiting"}
    msg, dead = compose_failure(0, 3, own, states, waited_s=0.4, timeout_s=120, settle_s=2.0)
    assert dead == (1,)
    assert msg.startswith("rank 1 died at the collective of step 3 ("), msg
    assert "rank 0 noticed at once, 0.4 s into step 3 in group tp[0,1]" in msg
    assert "rank 2 reported no failure within 2 s" in msg and "not a cause" in msg
    assert "ranks 1, 2" not in msg and "120" not in msg and "did not arrive" not in msg


def test_2d_rank_blocked_on_a_live_rank_names_the_dead_one_from_the_records():
    from adaptdist.runtime.heartbeat import compose_failure, own_failure, peer_states
    from adaptdist.errors import ShmPeerError

    own = own_failure(ShmPeerError(_GONE_0, "adaptdist:dp[0,2]", 0, 0, 100))
    r0_error = "CollectiveTimeoutError: rank 1 died at the collective of step 3 (its process is gone); rank 0 noticed"
    recs = _records(r0={"state": "failed", "error": r0_error, "dead_ranks": [1], "peer_lost": True},
                    r3={"state": "failed", "error": r0_error.replace("rank 0", "rank 3"), "dead_ranks": [1]})
    # the store died with rank 0: no marks, no beats; rank 1's record is still 'running' and its pid is gone
    states = peer_states(2, 4, 3, own, waiting={}, beats={}, records=recs, store_read=False, now=0.0, host="h",
                         alive=lambda pid: pid != 101)
    assert {r: st.kind for r, st in states.items()} == {0: "failed", 1: "dead", 3: "failed"}
    msg, dead = compose_failure(2, 3, own, states, waited_s=2.6, timeout_s=120, settle_s=2.0, store_lost=True)
    assert dead == (1,)
    assert msg.startswith("rank 1 died at the collective of step 3 (its process, pid 101 on h, is gone"), msg
    assert ("rank 2's collective failed 2.6 s into step 3 in group dp[0,2]" in msg
            and "rank 0, which it waited on, exited after a failure of its own" in msg), msg
    assert "most likely died" not in msg and "120" not in msg
    # another host's ranks: no pid to ask; rank 0's record still names rank 1 dead
    states = peer_states(2, 4, 3, own, waiting={}, beats={}, records=recs, store_read=False, now=0.0, host="other",
                         alive=lambda pid: True)
    assert states[1].kind == "dead" and states[1].how == "rank 0 saw its process end"


def test_2d_rank_without_records_does_not_claim_its_live_peer_died():
    """No record readable (another host's, no shared OUT) and no store: rank 0 is gone, cause unknown: said so."""
    from adaptdist.runtime.heartbeat import compose_failure, own_failure, peer_states
    from adaptdist.errors import ShmPeerError

    own = own_failure(ShmPeerError(_GONE_0, "adaptdist:dp[0,2]", 0, 0, 100))
    states = peer_states(2, 4, 3, own, waiting={}, beats={}, records={}, store_read=False, now=0.0, host="h")
    assert {r: st.kind for r, st in states.items()} == {0: "gone", 1: "silent", 3: "silent"}
    msg, dead = compose_failure(2, 3, own, states, waited_s=2.6, timeout_s=120, settle_s=2.0, store_lost=True)
    assert dead == () and "died or exited after a failure of its own" in msg and "most likely" not in msg, msg


def test_named_timeout_reads_the_records_when_the_store_host_is_gone(tmp_path):
    """End to end on rank 2 of the 2-D case: rank 0 (the store's host) exited after its own failure, rank 1 was
    killed; the message names rank 1 and the real wait, and the store is not touched (its host is gone)."""
    from adaptdist.errors import ShmPeerError
    from adaptdist.runtime.rank_status import RankStatus

    status_dir = tmp_path / "status" / "attempt0"
    RankStatus(tmp_path, 0, 0).update(state="failed", step=3, error="CollectiveTimeoutError: rank 1 died at ...",
                                      error_type="CollectiveTimeoutError", dead_ranks=[1], peer_lost=True)
    r1 = RankStatus(tmp_path, 1, 0)
    r1.update(pid=2**22 + 12345)  # no such process (above the default pid_max)
    RankStatus(tmp_path, 2, 0)

    class DeadStore:
        def __getattr__(self, name):
            raise AssertionError(f"the store was used ({name}) although its host is gone")

    hb = Heartbeat(2, 3, DeadStore(), collective_timeout_s=120, status_dir=status_dir)
    err = named_timeout(ShmPeerError(_GONE_0, "adaptdist:dp[0,2]", 0, 0, 100), hb, 3, waited_s=2.6)
    msg = str(err)
    assert isinstance(err, CollectiveTimeoutError) and err.dead_ranks == (1,), msg
    assert msg.startswith("rank 1 died at the collective of step 3 (its process, pid 4206649"), msg
    assert "2.6 s into step 3" in msg and "rank 0, which it waited on, exited after a failure of its own" in msg


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_2d_mesh_kill_every_survivor_names_the_killed_rank(tmp_path):
    """dp=2,tp=2 on 4 ranks, rank 1 SIGKILLed before step 3: every survivor's recorded error names rank 1 dead
    (not the live rank 0 or 2 it waited on), and the log has no C++ stack frames (they go to the debug logs)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "ADAPTDIST_INJECT_FAULT": "kill:1:3"}
    proc = subprocess.run([sys.executable, "-m", "adaptdist.cli", "train", "--nproc", "4", "--mesh", "dp=2,tp=2",
                           "--plan", "dp,tp", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
                           "--threads-per-rank", "1", "--sample-bytes", "0", "--checkpoint-every", "2",
                           "--max-restarts", "1", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=280)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    recs = {r: json.loads((out / "status" / "attempt0" / f"rank{r}.json").read_text()) for r in range(4)}
    assert recs[1]["state"] == "running"  # killed without a word
    for r in (0, 2, 3):
        assert recs[r]["state"] == "failed" and recs[r]["dead_ranks"] == [1], recs[r]
        assert recs[r]["error"].startswith("CollectiveTimeoutError: rank 1 died at the collective of step 3"), recs[r]
        assert "most likely died" not in recs[r]["error"] and "waited --collective-timeout-s" not in recs[r]["error"]
    assert "frame #" not in log and "TCPStore.cpp" not in log, log[-3000:]
    assert "restart 1: rank 1 (pid" in log


def test_a_killed_unreaped_process_is_not_alive():
    import os
    import signal
    import subprocess

    from adaptdist.runtime.heartbeat import _pid_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _pid_alive(child.pid) and _pid_alive(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # returns once it has died; leaves it a zombie
        assert not _pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not _pid_alive(child.pid)
