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
