"""Per-op rules, checked on single nodes of tiny graphs."""

import pytest
import torch
import torch.fx

from adaptdist.errors import UnsupportedOpError
from adaptdist.passes.sharding_rules import apply_rule
from adaptdist.placement import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


def node(target, *args, val_shape, arg_shapes):
    """A call node whose tensor args are placeholders of the given shapes."""
    g = torch.fx.Graph()
    phs = []
    for i, s in enumerate(arg_shapes):
        ph = g.placeholder(f"a{i}")
        ph.meta["val"] = torch.empty(s)
        phs.append(ph)
    it = iter(phs)
    real_args = tuple(next(it) if a is ... else a for a in args)
    n = g.call_function(target, real_args)
    n.meta["val"] = torch.empty(val_shape)
    return n, phs


def run(n, placements):
    pl = dict(zip([a for a in n.args if isinstance(a, torch.fx.Node)], placements))
    return apply_rule(n, lambda a: pl[a])


def test_view_merge_and_split_keep_the_batch_dim_outermost():
    n, _ = node(aten.view.default, ..., [32, 4], val_shape=[32, 4], arg_shapes=[[4, 8, 4]])
    assert run(n, [Shard(0)]).out == Shard(0)
    n, _ = node(aten.view.default, ..., [4, 8, 4], val_shape=[4, 8, 4], arg_shapes=[[32, 4]])
    assert run(n, [Shard(0)]).out == Shard(0)
    n, _ = node(aten.view.default, ..., [32], val_shape=[32], arg_shapes=[[8, 4]])
    res = run(n, [Shard(1)])  # an inner dim cannot stay a contiguous shard when flattened: gather
    assert res.out == R and res.needs == {(0,): R}


def test_mm_layouts():
    n, _ = node(aten.mm.default, ..., ..., val_shape=[8, 3], arg_shapes=[[8, 4], [4, 3]])
    assert run(n, [Shard(0), R]).out == Shard(0)
    assert run(n, [Shard(1), Shard(0)]).out == P  # contraction over the sharded dim
    assert run(n, [R, Shard(1)]).out == Shard(1)
    res = run(n, [Shard(1), R])
    assert res.out == P and res.needs == {(1,): Shard(0)}


def test_partial_stays_partial_only_through_linear_ops():
    n, _ = node(aten.mul.Tensor, ..., 2.0, val_shape=[3], arg_shapes=[[3]])
    assert run(n, [P]).out == P
    n, _ = node(aten.add.Tensor, ..., 1.0, val_shape=[3], arg_shapes=[[3]])
    res = run(n, [P])
    assert res.out == R and res.needs == {(0,): R}
    n, _ = node(aten.add.Tensor, ..., ..., val_shape=[3], arg_shapes=[[3], [3]])
    assert run(n, [P, P]).out == P
    res = run(n, [P, R])
    assert res.out == R and res.needs == {(0,): R}
    n, _ = node(aten.exp.default, ..., val_shape=[3], arg_shapes=[[3]])
    assert run(n, [P]).needs == {(0,): R}


def test_pointwise_broadcast_slices_full_size_replicated_inputs():
    n, _ = node(aten.add.Tensor, ..., ..., val_shape=[6, 4], arg_shapes=[[6, 4], [4]])
    assert run(n, [Shard(0), R]).needs == {}  # the bias broadcasts over the batch
    n, _ = node(aten.add.Tensor, ..., ..., val_shape=[6, 4], arg_shapes=[[6, 4], [6, 4]])
    assert run(n, [Shard(0), R]).needs == {(1,): Shard(0)}


def test_sum_over_sharded_dim_is_partial_and_max_is_refused():
    n, _ = node(aten.sum.dim_IntList, ..., [0], val_shape=[4], arg_shapes=[[6, 4]])
    assert run(n, [Shard(0)]).out == P
    n, _ = node(aten.sum.dim_IntList, ..., [1], val_shape=[6], arg_shapes=[[6, 4]])
    assert run(n, [Shard(0)]).out == Shard(0)
    n, _ = node(aten.amax.default, ..., [0], val_shape=[4], arg_shapes=[[6, 4]])
    res = run(n, [Shard(0)])  # (opinfo90) max over the shard: each rank's, all-reduced by all_reduce_extrema
    assert res.out == R and res.needs == {}
    n, _ = node(aten.amax.default, ..., [1], val_shape=[6], arg_shapes=[[6, 4]])
    assert run(n, [Shard(0)]).out == Shard(0)


def test_ops_without_rules_are_fine_when_replicated():
    n, _ = node(aten._pdist_forward.default, ..., val_shape=[15], arg_shapes=[[6, 4]])  # (renorm, trace have rules)
    assert run(n, [R]).out == R
    with pytest.raises(UnsupportedOpError, match="_pdist_forward"):  # neither ours nor DTensor's
        run(n, [Shard(0)])


def test_grouped_mm_refusal_points_hugging_face_moes_to_batched_mm():
    """A Hugging Face MoE (Mixtral, Qwen2-MoE) built from a config calls aten._grouped_mm by default: the refusal
    says which config setting lowers instead (fresh-user report: the error named only --replicate-fallback)."""
    n, _ = node(aten._grouped_mm.default, ..., ..., val_shape=[6, 3], arg_shapes=[[6, 4], [2, 4, 3]])
    with pytest.raises(UnsupportedOpError, match="experts_implementation='batched_mm'"):
        run(n, [Shard(0), R])
    n, _ = node(aten._pdist_forward.default, ..., val_shape=[15], arg_shapes=[[6, 4]])
    with pytest.raises(UnsupportedOpError) as refused:
        run(n, [Shard(0)])
    assert "batched_mm" not in str(refused.value)  # the hint is for grouped_mm only


def test_ops_without_our_rule_take_the_dtensor_strategy_that_moves_least():
    """The sources the planner lists: topk along the last dim keeps a batch shard (nothing moves);
    a cumulative sum over the sharded dim moves the shard to another dim rather than gather it all."""
    n, _ = node(aten.topk.default, ..., 3, -1, val_shape=[6, 3], arg_shapes=[[6, 4]])
    n.meta["val"] = (torch.empty(6, 3), torch.empty(6, 3, dtype=torch.long))
    res = run(n, [Shard(0)])
    assert res.out == (Shard(0), Shard(0)) and res.needs == {}
    n, _ = node(aten.cumsum.default, ..., 0, val_shape=[6, 4], arg_shapes=[[6, 4]])
    res = run(n, [Shard(0)])
    assert res.out == Shard(1) and res.needs == {(0,): Shard(1)}


@pytest.mark.parametrize("target, args", [(aten.native_dropout.default, (..., 0.5, True)),
                                          (aten.bernoulli.p, (..., 0.5)), (aten.rand_like.default, (...,))])
def test_random_ops_never_draw_a_replicated_value_on_every_rank(target, args):
    """Each rank drawing the whole replicated tensor would draw different numbers for one value: split, on dim 0
    (the batch's, or the backend's rank dim) where it has rows, else on the largest dim."""
    n, _ = node(target, *args, val_shape=[4, 16], arg_shapes=[[4, 16]])
    res = run(n, [R])
    out = res.out[0] if isinstance(res.out, tuple) else res.out
    assert out == Shard(0) and list(res.needs.values()) == [Shard(0)]
    one, _ = node(target, *args, val_shape=[1, 16], arg_shapes=[[1, 16]])
    res = run(one, [R])
    assert (res.out[0] if isinstance(res.out, tuple) else res.out) == Shard(1) and list(res.needs.values()) == [Shard(1)]
    res = run(n, [Shard(0)])
    assert (res.out[0] if isinstance(res.out, tuple) else res.out) == Shard(0) and not res.needs


# ---------------------------------------------------------------- a view splitting a shard into groups (hfix9a)
# A packed q/k/v projection's output [.., 3E] chunked over 2 ranks ([0, 1.5E)) does not split into 3 groups of
# E: the rule must gather it (every plan lowers through this rule), and the planner must not be offered the
# shard-keeping strategy; on 3 ranks the chunks are whole groups and the shard survives.

def _param_then_view(groups, k, rows=4):
    """``view(add(x, w), [rows, groups, k])`` with ``w`` a [groups*k] parameter placeholder (x replicated)."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(rows, groups * k), torch.empty(groups * k)
    add = g.call_function(aten.add.Tensor, (x, w))
    add.meta["val"] = torch.empty(rows, groups * k)
    v = g.call_function(aten.view.default, (add, [rows, groups, k]))
    v.meta["val"] = torch.empty(rows, groups, k)
    return v, add, x, w


@pytest.mark.parametrize("world,keeps", [(2, False), (3, True), (4, False), (1, True)])
def test_view_splitting_a_chunked_dim_keeps_the_shard_only_on_whole_groups(world, keeps):
    v, add, x, w = _param_then_view(3, 16)
    pls = {x: R, w: Shard(0), add: Shard(1)}
    res = apply_rule(v, lambda a: pls[a], world)
    if keeps:
        assert res.out == Shard(1) and not res.needs
    else:
        assert res.out == R and res.needs == {(0,): R}


def test_view_copy_splits_a_shard_as_view_does():
    """``view_copy`` takes view's rule with the mesh size (it kept a shard view gathers, which lowering refused)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(12)
    outs = {}
    for op in (aten.view.default, aten.view_copy.default):
        outs[op] = g.call_function(op, (x, [3, 4]))
        outs[op].meta["val"] = torch.empty(3, 4)
    pls = {x: Shard(0)}
    got = {op: apply_rule(n, lambda a: pls[a], 2).out for op, n in outs.items()}
    assert got[aten.view.default] == R and got[aten.view_copy.default] == R, got


def test_view_splitting_a_merged_batch_keeps_the_shard_whatever_the_rows():
    # [7, 8, 16] batch S(0) -> [56, 16] -> [7, 8, 16]: 7 rows over 2 ranks (4 + 3) are whole groups of 8
    g = torch.fx.Graph()
    b = g.placeholder("b")
    b.meta["val"] = torch.empty(7, 8, 16)
    m = g.call_function(aten.view.default, (b, [56, 16]))
    m.meta["val"] = torch.empty(56, 16)
    v = g.call_function(aten.view.default, (m, [7, 8, 16]))
    v.meta["val"] = torch.empty(7, 8, 16)
    pls = {b: Shard(0), m: Shard(0)}
    assert apply_rule(v, lambda a: pls[a], 2).out == Shard(0)
    assert apply_rule(v, lambda a: pls[a], 3).out == Shard(0)


def test_planner_is_not_offered_a_view_that_splits_a_shard_into_broken_groups():
    from adaptdist.passes.context import PassContext
    from adaptdist.passes.list_strategies import node_strategies
    v, *_ = _param_then_view(3, 16)

    def offered(world):  # (inputs, outputs) of every strategy, DTensor's and ours
        return [(s.inputs, s.outputs) for s in node_strategies(v, PassContext(axis_size=world, batch_size=4))]

    keep = ((Shard(1),), (Shard(1),))
    assert keep not in offered(2) and keep not in offered(4)
    assert keep in offered(3)


class _PackedQKV(torch.nn.Module):
    """A packed q/k/v Linear viewed into [B, T, 3, D] (as GPT-2's c_attn or nn.MultiheadAttention's in_proj),
    nn.MultiheadAttention (its own packed in_proj viewed into 3 groups), a Linear viewed into 2 heads."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.heads = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).view(b, t, 3, 16).unbind(2)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v) + x
        a, _ = self.mha(h, h, h, need_weights=False)
        h = h + a
        # 16 outputs viewed into 2 heads of 8: chunked over 3 ranks ([0, 6)) they are not whole heads
        q = self.heads(h).view(b, t, 2, 8).transpose(1, 2)
        s = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return self.out(h + s.transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_packed_qkv_view_equals_eager(world):
    """``--plan fsdp`` on 2 and 3 ranks: 48 = 3 x 16 outputs chunked over 2 ranks, and 16 = 2 x 8 over 3, are not
    whole groups (both used to raise UnsupportedOpError in localize_shapes: fsdp's dim-0 weight shards were used
    column-parallel up to the view); loss, gradients and SGD-updated parameters equal eager."""
    from passutil import assert_sgd_equal, simulated_sgd
    from reference import eager_sgd

    torch.manual_seed(0)
    model = _PackedQKV()
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(7, 6, 16, generator=g), torch.randint(0, 5, (7, 6), generator=g))

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1), reduction="sum") / 10

    _, hist, params, _ = simulated_sgd(model, batch, loss_fn, world, "fsdp", 0.1, 3)
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, 0.1, 3)
    assert_sgd_equal(hist, params, want_hist, want_params, tol=1e-5)


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "dp=1,tp=3"])
def test_manual_tp_on_packed_qkv_gathers_before_the_view(mesh):
    """A plan file sharding the packed projections column-parallel (S(0) on tp): on 2 tp ranks 3 x 16 outputs
    are not whole groups (used to raise in localize_shapes), on 3 the 2 x 8 heads are not; every rank's loss and
    gradient shards equal eager."""
    from adaptdist.annotations import ManualPlan
    from passutil import check_mesh_against_eager

    torch.manual_seed(0)
    model = _PackedQKV()
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(6, 5, 16, generator=g), torch.randint(0, 5, (6, 5), generator=g))
    plan = ManualPlan("packed", ("dp", "tp"), "dp", tuple((f, ("R", "S(0)")) for f in (
        "qkv.weight", "qkv.bias", "mha.in_proj_weight", "mha.in_proj_bias", "heads.weight", "heads.bias")))
    check_mesh_against_eager(model, batch, lambda o, y: torch.nn.functional.cross_entropy(o.reshape(-1, 5), y.reshape(-1)),
                             mesh, plan)
