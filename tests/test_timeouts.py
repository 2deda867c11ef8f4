"""Timeouts: derived in order from the collective timeout; explicit settings that break the order refused."""

from __future__ import annotations

import pytest

from adaptdist.errors import UsageError
from adaptdist.runtime.timeouts import RESTART_STOP_S, WORKER_START_S, Timeouts


def test_defaults_are_the_derived_values_of_120_s():
    assert Timeouts() == Timeouts.for_collective(120.0)
    assert Timeouts().check() == Timeouts()


@pytest.mark.parametrize("collective_s", [1.0, 3.0, 60.0, 120.0, 900.0, 3600.0])
def test_derived_timeouts_keep_the_order(collective_s):
    t = Timeouts.for_collective(collective_s)
    waits = max(t.collective_s, t.compile_wait_s)
    assert t.store_s >= waits
    assert t.rendezvous_join_s > (waits + max(RESTART_STOP_S, t.shutdown_grace_s) + WORKER_START_S
                                  + t.keep_alive_expiry_s + t.rendezvous_last_call_s)
    assert t.rendezvous_last_call_s < t.rendezvous_join_s
    assert t.compile_wait_s >= t.collective_s


def test_overrides_are_kept_and_the_rest_derived_after_them():
    t = Timeouts.for_collective(120, shutdown_grace_s=90)
    assert t.shutdown_grace_s == 90 and t.rendezvous_join_s > 300 + 90 + WORKER_START_S
    with pytest.raises(UsageError, match="no field bogus_s"):
        Timeouts.for_collective(120, bogus_s=1)


def test_check_names_both_values_of_a_broken_order():
    with pytest.raises(UsageError) as info:
        Timeouts(collective_s=600, compile_wait_s=60, store_s=700, rendezvous_join_s=300).check()
    msg = str(info.value)
    assert "rendezvous_join_s=300" in msg and "collective_s=600" in msg
    with pytest.raises(UsageError, match=r"store_s=100 must be at least compile_wait_s=300"):
        Timeouts(store_s=100).check()
    with pytest.raises(UsageError, match="collective_s must be positive"):
        Timeouts(collective_s=0).check()
    with pytest.raises(UsageError, match="keep_alive_attempts=1"):
        Timeouts(keep_alive_attempts=1).check()


def test_with_collective_keeps_what_still_fits():
    t = Timeouts().with_collective(30)
    assert t.collective_s == 30 and t.rendezvous_join_s == Timeouts().rendezvous_join_s
    big = Timeouts().with_collective(1000)
    assert big.collective_s == 1000 and big.rendezvous_join_s > 1000 and big.store_s >= 1000


def test_rdzv_configs_are_torchrun_keys_in_whole_seconds():
    conf = Timeouts.for_collective(3).rdzv_configs()
    assert conf["last_call_timeout"] == 2 and conf["keep_alive_interval"] == 2
    assert conf["keep_alive_max_attempt"] == 3 and conf["join_timeout"] >= 300
    arg = Timeouts().rdzv_conf_arg(is_host=False)
    assert arg.endswith("is_host=false") and "join_timeout=370" in arg
