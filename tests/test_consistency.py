import pytest

from adaptdist.compiler.consistency import check_collectives, collective_calls
from adaptdist.lowering_options import LoweringOptions
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import CollectiveMismatchError
from models import mlp, tiny_gpt


def test_lowered_programs_agree_on_every_collective():
    model, batch, loss_fn = tiny_gpt(5, 8)
    progs = compile_model(model, batch, loss_fn, 3, options=LoweringOptions(grad_bucket_bytes=4096))  # uneven, one rank small
    check_collectives(progs)
    calls = [collective_calls(p) for p in progs.values()]
    assert len(calls[0]) > 3 and all([c.key() for c in cs] == [c.key() for c in calls[0]] for cs in calls)


def test_a_rank_with_a_different_collective_is_refused_naming_both_ranks_and_the_node():
    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2)
    gm = progs[1].module
    ar = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    ar.args = (ar.args[0], ar.args[1], "adaptdist:other")  # as if rank 1 used another group
    with pytest.raises(CollectiveMismatchError) as e:
        check_collectives(progs)
    msg = str(e.value)
    assert "rank 0" in msg and "rank 1" in msg and ar.name in msg and "adaptdist:other" in msg


def test_a_rank_with_a_missing_collective_is_refused():
    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2)
    gm = progs[1].module
    wait = next(n for n in reversed(gm.graph.nodes) if "wait_tensor" in str(n.target))
    ar = wait.args[0]
    wait.replace_all_uses_with(ar.args[0])
    gm.graph.erase_node(wait)
    gm.graph.erase_node(ar)
    with pytest.raises(CollectiveMismatchError, match="would hang"):
        check_collectives(progs)


def test_collectives_must_be_what_the_plan_implies():
    """Each axis's collectives are exactly the kinds its reshard points imply; a collective the
    plan does not call for, or a missing one, is a compile-time error naming the axis and node."""
    import dataclasses

    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.consistency import check_against_plan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.errors import CollectiveMismatchError
    from adaptdist.placement import Partial, Replicate, Shard
    from adaptdist.plan import LoweringRecord, Redistribution
    from models import mlp

    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))
    plan = progs[0].plan
    record = plan.lowered
    kinds = {f"{r.src!r}->{r.dst!r}" for r in record.redistributions["dp"]}
    assert "S(0)->R" in kinds and "P(sum)->S(0)" in kinds  # parameter gathers, gradient reduce_scatters
    check_against_plan(progs, plan)
    no_gathers = dataclasses.replace(plan, lowered=dataclasses.replace(record, redistributions={
        "dp": tuple(r for r in record.redistributions["dp"] if not isinstance(r.src, Shard))}))
    with pytest.raises(CollectiveMismatchError, match="issues all_gather_into_tensor on mesh axis 'dp'.*records no"):
        check_against_plan(progs, no_gathers)
    extra = dataclasses.replace(plan, mesh={"dp": 2, "tp": 1}, param_placements={}, lowered=LoweringRecord(
        redistributions={"dp": record.redistributions["dp"] + (Redistribution("x", "y", Shard(1), Replicate(),
                                                                              "all_gather_into_tensor"),),
                         "tp": (Redistribution("x", "y", Partial(), Replicate(), "all_reduce"),)}))
    with pytest.raises(CollectiveMismatchError, match="reshard point needing all_reduce on mesh axis 'tp'.*issues none"):
        check_against_plan(progs, extra)
    # the decision is checked too: a parameter the plan shards must be lowered sharded
    moved = dataclasses.replace(plan, param_placements={**plan.param_placements, "fc1.weight": (Shard(1),)})
    with pytest.raises(CollectiveMismatchError, match=r"decided fc1.weight S\(1\) on mesh axis 'dp'.*placed it S\(0\)"):
        check_against_plan(progs, moved)
