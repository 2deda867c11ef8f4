"""Pipeline schedules: validation, deadlock freedom under blocking send/recv, and the bubble of the real lists."""

from __future__ import annotations

import pytest

from adaptdist.errors import PipelineScheduleError
from adaptdist.pipeline_schedules import (SCHEDULES, Action, check_deadlock_free, check_schedule, compute_order,
                                          pipeline_order, simulate_timeline, stage_rank, stages_per_rank)


def _valid(schedule: str, p: int, m: int) -> bool:
    return schedule == "gpipe" or m >= p


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_every_schedule_terminates_under_blocking_send_recv(schedule, p, m):
    if not _valid(schedule, p, m):
        with pytest.raises(PipelineScheduleError, match=f"{m} microbatches < {p} stages"):
            pipeline_order(schedule, p, m)
        return
    v = stages_per_rank(schedule)
    order = pipeline_order(schedule, p, m)  # runs check_deadlock_free itself; again here, explicitly
    check_deadlock_free(order, p, p * v, m, schedule=schedule)
    assert sorted(order) == list(range(p))
    for r, acts in order.items():
        assert all(stage_rank(a.stage, p) == r for a in acts)
        kinds = {a.kind for a in acts}
        assert ("I" in kinds and "W" in kinds and "B" not in kinds) if schedule == "zb" else ("B" in kinds)
        # every message sent is received by the peer, once
        for a in acts:
            if a.kind.startswith("SEND"):
                want = Action(a.peer_stage, "RECV" + a.kind[4:], a.microbatch)
                assert order[stage_rank(a.peer_stage, p)].count(want) == 1


def test_the_checker_finds_a_deadlock_and_names_it():
    # both ranks wait to receive before they send: rank 0 receives B0 before sending F0
    order = {0: [Action(0, "F", 0), Action(0, "RECV_B", 0), Action(0, "SEND_F", 0), Action(0, "B", 0)],
             1: [Action(1, "RECV_F", 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, "SEND_B", 0)]}
    with pytest.raises(PipelineScheduleError, match=r"deadlock(.|\n)*rank 0: at 0RECV_B0(.|\n)*rank 1: at 1RECV_F0"):
        check_deadlock_free(order, 2, 2, 1)
    # a send before its compute, and a missing backward
    with pytest.raises(PipelineScheduleError, match="sends 0SEND_F0 before computing it"):
        check_deadlock_free({0: [Action(0, "SEND_F", 0), Action(0, "F", 0)], 1: [Action(1, "RECV_F", 0)]}, 2, 2, 1)
    with pytest.raises(PipelineScheduleError, match="stage 0 microbatch 0 on rank 0 does not run F and exactly one"):
        check_deadlock_free({0: [Action(0, "F", 0), Action(0, "SEND_F", 0)],
                             1: [Action(1, "RECV_F", 0), Action(1, "F", 0)]}, 2, 2, 1)


def test_bad_numbers_are_typed_errors_naming_them():
    with pytest.raises(PipelineScheduleError, match="unknown pipeline schedule 'pipedream'.*gpipe, 1f1b"):
        check_schedule("pipedream", 2, 4)
    with pytest.raises(PipelineScheduleError, match="3 microbatches < 4 stages.*--microbatches 4"):
        check_schedule("1f1b", 4, 3)
    with pytest.raises(PipelineScheduleError, match=r"9 microbatches on 4 pipeline ranks make 2 rounds.*9 % 2"):
        check_schedule("interleaved-1f1b", 4, 9)
    with pytest.raises(PipelineScheduleError, match="at least 2 stages per rank"):
        check_schedule("interleaved-1f1b", 2, 4, per_rank=1)
    with pytest.raises(PipelineScheduleError, match="runs 1 stage per rank, got 2"):
        check_schedule("zb", 2, 4, per_rank=2)
    assert check_schedule("gpipe", 4, 2) == 1  # GPipe runs any count
    assert check_schedule("interleaved-1f1b", 4, 6) == 2  # torch: 1 round of 6


def test_1f1b_is_pipedream_flush():
    order = compute_order("1f1b", 2, 4)
    assert [str(a) for a in order[0]] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3".split()
    assert [str(a) for a in order[1]] == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3".split()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5)])
def test_the_lists_bubble_is_the_closed_form(schedule, p, m, times):
    """The simulated idle share of the real lists equals the formula cost_models uses (per-rank times f, b, w;
    GPipe/1F1B (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); ZB-H1 (p-1)(f+b-w) / (m(f+b+w) + (p-1)(f+b-w)))."""
    f, b, w = times
    v = stages_per_rank(schedule)
    t = simulate_timeline(pipeline_order(schedule, p, m), p, p * v, f / v, b / v, w / v)
    expected = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
                "interleaved-1f1b": (p - 1) / (v * m + p - 1),
                "zb": (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))}[schedule]
    assert t.bubble_fraction == pytest.approx(expected, abs=1e-9)
