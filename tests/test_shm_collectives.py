"""Shared-memory collectives across real ranks (spawned processes, gloo for the rendezvous and as the
reference): every op, dtype and payload path against gloo on groups of 4, 3 and 2 ranks (two pairs of
size-2 groups at once); a stalled and a killed peer named within the timeout; /dev/shm clean afterwards.
Sizes here are 0, 1, 7, 1001 and 1 MiB (float32), and 37 and 2 Mi + 5 elements for special values (NaN, inf,
-0.0, overflow, bfloat16 rounding ties) through the vectorised reductions and their non-temporal-store path, with a
check that a later all_reduce never overwrites an output the caller still holds (large outputs are reused);
16/64 MiB run in benchmarks/stress_shm.py and bench_comm.py."""

from __future__ import annotations

import pytest

import adaptdist.kernels as kernels
import shm_workers as w

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.available(), reason=f"C++ kernels not built: {kernels.load_error()}")]

SIZES = [0, 1, 7, 1001, 1 << 18]


@pytest.mark.timeout(400)
def test_results_equal_gloo_on_4_3_and_2_ranks_and_segments_are_gone():
    port = w.free_port()
    res = w.run_ranks(w.correctness_worker, 4, (SIZES,), timeout_s=360, port=port)
    assert sorted(res) == [0, 1, 2, 3], res
    for rank, out in res.items():
        assert "error" not in out, out.get("error")
        assert out["failures"] == [], (rank, out["failures"][:20])
        assert out["cases"] > 300 if rank < 3 else out["cases"] > 200
        assert out["segments"] == []  # unlinked as soon as every rank attached
    assert len(set(res[0]["pids"])) == 4
    assert w.segments(port) == []  # and nothing after a normal exit


@pytest.mark.timeout(300)
def test_stalled_and_killed_peers_are_named_within_the_timeout():
    port = w.free_port()
    stall_timeout_s = 1.5
    res = w.run_ranks(w.fault_worker, 3, (stall_timeout_s,), timeout_s=240, port=port)
    assert 2 not in res  # rank 2 SIGKILLed itself
    for rank in (0, 1):
        out = res[rank]
        assert "error" not in out, out.get("error")
        text, peer_group_rank, peer_global_rank, peer_pid = out["stall"]
        assert (peer_group_rank, peer_global_rank) == (2, 2) and "stalled" in text and "1.5 s" in text
        assert stall_timeout_s <= out["stall_s"] < stall_timeout_s + 1.5
        # waiting does not burn a core a peer needs (issue 16 point 2): a bounded spin, then futex sleeps. Measured
        # at load ~10 on 2 cores: 0.5% of the wait; the same wait spinning 1.4 s (spin_us=1.4e6): 12% (a spinner
        # gets only its share of a loaded core, so the bound is low)
        assert out["stall_cpu_s"] < 0.05 * out["stall_s"], (rank, out["stall_cpu_s"], out["stall_s"])
        text, peer_group_rank, peer_global_rank, victim = out["killed"]
        assert (peer_group_rank, peer_global_rank) == (2, 2) and "died" in text and f"pid {victim}" in text
        assert out["killed_s"] < 5.0  # the timeout is 60 s: a dead peer is noticed at once
        assert out["segments"] == []
    assert res[0]["killed"][3] == res[1]["killed"][3]
    assert w.segments(port) == []  # after the crash too


# 0, 1, odd, 1 MiB (float32) and over 4 MiB for every dtype (the non-temporal-store path)
REGISTERED_SIZES = [0, 1, 1001, 1 << 18, (1 << 21) + 13]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_registered_input_all_reduce_equals_the_copy_in_path(world):
    """Issue 16 point 5: an all_reduce whose input is in the registered input region (shm.input_buffer) reads it in
    place and gives bitwise the copy-in path's result (float32/bfloat16/float16, sum/avg/max, blocking and started,
    comm thread off and on, two pairs at once on 4 ranks); mismatched registration falls back on every rank; the
    fused bucket op equals cat + all_reduce bitwise."""
    port = w.free_port()
    res = w.run_ranks(w.registered_worker, world, (REGISTERED_SIZES,), timeout_s=540, port=port)
    assert sorted(res) == list(range(world)), res
    for rank, out in res.items():
        assert "error" not in out, out.get("error")
        assert out["failures"] == [], (rank, out["failures"][:20])
        assert out["cases"] >= 200
        assert out["segments"] == []
    assert w.segments(port) == []
