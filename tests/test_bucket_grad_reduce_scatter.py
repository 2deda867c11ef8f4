"""bucket_grad_reduce_scatter: sharded parameters' gradients reduce-scattered in buckets of at most
``bucket_bytes``, in the order backward produces them, each issued after its last gradient."""

import dataclasses

from adaptdist import graph_meta as gmeta
from adaptdist.passes.bucket_grad_reduce_scatter import bucket_grad_reduce_scatter
from models import tiny_gpt
from passutil import assert_untouched, apply_pass, check_mesh_against_eager, collective_nodes, fsdp_placements, lowered_until


def _before(**ctx_fields):
    model, batch, loss_fn = tiny_gpt(4, 8)
    return lowered_until((model, batch, loss_fn), 2, fsdp_placements(model), stop_before="bucket_grad_reduce_scatter",
                         **ctx_fields)


def _bytes(n):
    v = n.meta["val"]
    return v.numel() * v.element_size()


def _grad_scatters(gm):
    """Reduce_scatters whose result goes (through trims) only to the graph's output: the gradients'."""
    out = []
    for rs in collective_nodes(gm, "reduce_scatter"):
        n = next(iter(rs.users))
        while len(n.users) == 1 and n.op != "output":
            n = next(iter(n.users))
        if n.op == "output":
            out.append(rs)
    return out


def test_one_bucket_holds_every_gradient_with_the_default_size():
    _, gm, ctx = _before()
    grads = _grad_scatters(gm)
    total = sum(_bytes(rs.args[0]) for rs in grads)
    assert len(grads) > 10 and total <= ctx.bucket_bytes
    others = len(collective_nodes(gm, "reduce_scatter")) - len(grads)
    gm, changed = apply_pass(bucket_grad_reduce_scatter, gm, ctx)
    assert changed
    rss = collective_nodes(gm, "reduce_scatter")
    assert len(rss) == others + 1
    (rs,) = [r for r in rss if r not in set(grads)]
    assert _bytes(rs.args[0]) == total  # the padded gradients, concatenated
    assert rs.meta["val"].numel() * ctx.axis_size == rs.args[0].meta["val"].numel()
    nodes = list(gm.graph.nodes)
    wait = next(iter(rs.users))
    assert gmeta.get_collective(wait) == "wait" and nodes.index(wait) > nodes.index(rs)


def test_small_buckets_follow_backwards_order_and_the_limit():
    _, gm, ctx = _before()
    grads = _grad_scatters(gm)
    limit = 2 * max(_bytes(rs.args[0]) for rs in grads)
    ctx = dataclasses.replace(ctx, bucket_bytes=limit)
    gm, changed = apply_pass(bucket_grad_reduce_scatter, gm, ctx)
    assert changed
    nodes = list(gm.graph.nodes)
    buckets = [r for r in collective_nodes(gm, "reduce_scatter") if r not in set(grads)]
    kept = [r for r in collective_nodes(gm, "reduce_scatter") if r in set(grads)]  # alone in their bucket
    assert len(buckets) > 1 and len(buckets) + len(kept) < len(grads)
    for rs in buckets:
        assert _bytes(rs.args[0]) <= limit
        assert "cat" in str(rs.args[0].args[0].target)  # flat = reshape(cat(rows of each gradient))
    # each bucket is issued right after its last gradient: in backward's order, the first before the last
    # bucket's gradients exist (so it overlaps the rest of backward), the waits after every bucket is issued
    pos = [nodes.index(rs) for rs in buckets]
    assert pos == sorted(pos)
    assert pos[0] < nodes.index(buckets[-1].args[0].args[0])
    waits = [next(iter(rs.users)) for rs in buckets]
    assert min(nodes.index(w) for w in waits) > max(pos)


def test_untouched_with_one_gradient_scatter_or_none():
    _, gm, ctx = _before(bucket_bytes=1)  # every gradient its own bucket: nothing to merge
    gm = assert_untouched(bucket_grad_reduce_scatter, gm, ctx)
    model, batch, loss_fn = tiny_gpt(4, 8)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 2, stop_before="bucket_grad_reduce_scatter")  # dp
    gm = assert_untouched(bucket_grad_reduce_scatter, gm, ctx)


def test_fsdp_programs_with_bucketed_gradients_equal_eager():
    model, batch, loss_fn = tiny_gpt(4, 8)
    one = check_mesh_against_eager(model, batch, loss_fn, "dp=2", "fsdp")
    many = check_mesh_against_eager(model, batch, loss_fn, "dp=2", "fsdp", bucket_bytes=4096)
    count = [sum("reduce_scatter" in c for c in p[0].collectives()) for p in (one, many)]
    assert count[0] == 1 and count[1] > 2
