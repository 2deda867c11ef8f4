"""bucket_param_allgather: consecutive parameter all_gathers merged into buckets of at most
``gather_bucket_bytes``, never across the forward/backward boundary."""

import dataclasses

from adaptdist import graph_meta as gmeta
from adaptdist.passes.bucket_param_allgather import bucket_param_allgather
from models import tiny_gpt
from passutil import assert_untouched, apply_pass, check_mesh_against_eager, collective_nodes, fsdp_placements, lowered_until, loss_position


def _before(**ctx_fields):
    model, batch, loss_fn = tiny_gpt(4, 8)
    return lowered_until((model, batch, loss_fn), 2, fsdp_placements(model), stop_before="bucket_param_allgather",
                         **ctx_fields)



def _param_gathers(gm, group):
    """(all_gather node, its padded input's bytes) for every parameter gather, in program order."""
    out = []
    for n in collective_nodes(gm, "all_gather"):
        pad = n.args[0]
        if gmeta.get_gather_pad(pad, group) is not None:
            v = pad.meta["val"]
            out.append((n, v.numel() * v.element_size()))
    return out


def _buckets(gm, group):
    """The merged buckets: for each split of a bucketed gather, the pad names it holds."""
    return [gmeta.get_coalesced(n, group) for n in gm.graph.nodes if gmeta.get_coalesced(n, group)]


def test_one_bucket_per_side_of_the_loss_with_the_default_size():
    _, gm, ctx = _before()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss_pos = loss_position(gm)
    gathers = _param_gathers(gm, ctx.group_name)
    fwd = [b for g, b in gathers if order[g] <= loss_pos]
    bwd = [b for g, b in gathers if order[g] > loss_pos]
    assert fwd and bwd and sum(fwd) <= ctx.gather_bucket_bytes and sum(bwd) <= ctx.gather_bucket_bytes
    others = len(collective_nodes(gm, "all_gather")) - len(gathers)
    gm, changed = apply_pass(bucket_param_allgather, gm, ctx)
    assert changed
    ags = collective_nodes(gm, "all_gather")
    assert len(ags) == others + 2
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss_pos = loss_position(gm)
    merged = [g for g in ags if gmeta.get_gather_pad(g.args[0], ctx.group_name) is None]
    assert [order[g] <= loss_pos for g in merged] == [True, False]  # forward's bucket, then backward's
    sizes = [g.args[0].meta["val"].numel() * g.args[0].meta["val"].element_size() for g in merged]
    assert sizes == [sum(fwd), sum(bwd)]  # each bucket is its gathers' padded shards, flattened
    assert [len(b) for b in _buckets(gm, ctx.group_name)] == [len(fwd), len(bwd)]
    for g in merged:  # every rank brings its whole buffer: world x the local bucket
        assert g.meta["val"].numel() == ctx.axis_size * g.args[0].meta["val"].numel()


def test_bucket_size_limit_and_program_order_are_kept():
    _, gm, ctx = _before()
    gathers = _param_gathers(gm, ctx.group_name)
    limit = 3 * max(b for _, b in gathers)
    ctx = dataclasses.replace(ctx, gather_bucket_bytes=limit)
    pads_in_order = [g.args[0].name for g, _ in gathers]
    sizes = {g.args[0].name: b for g, b in gathers}
    gm, changed = apply_pass(bucket_param_allgather, gm, ctx)
    assert changed
    buckets = _buckets(gm, ctx.group_name)
    assert len(buckets) > 2
    for b in buckets:
        assert sum(sizes[p] for p in b) <= limit
    merged = [p for b in buckets for p in b]
    assert merged == [p for p in pads_in_order if p in set(merged)]  # buckets hold consecutive gathers, in order


def test_untouched_when_no_two_gathers_fit_a_bucket_or_nothing_is_gathered():
    _, gm, ctx = _before(gather_bucket_bytes=1)
    gm = assert_untouched(bucket_param_allgather, gm, ctx)
    model, batch, loss_fn = tiny_gpt(4, 8)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 2, stop_before="bucket_param_allgather")  # dp: replicated
    gm = assert_untouched(bucket_param_allgather, gm, ctx)


def test_fsdp_programs_with_bucketed_gathers_equal_eager():
    model, batch, loss_fn = tiny_gpt(4, 8)
    progs = check_mesh_against_eager(model, batch, loss_fn, "dp=2", "fsdp")
    n_sharded = sum(1 for f in progs[0].param_fqns if f in progs[0].state_placements)
    gathers = [c for c in progs[0].collectives() if "all_gather" in c]
    assert n_sharded > 10 and len(gathers) == 2
