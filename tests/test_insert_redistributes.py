import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist import graph_meta as gmeta
from adaptdist.passes.globalize_reductions import globalize_reductions
from adaptdist.passes.insert_redistributes import insert_redistributes
from adaptdist.passes.propagate_placements import placement_of, propagate_placements
from adaptdist.placement import Replicate
from models import mlp
from passutil import captured_with_ctx, simulate
from reference import eager_sgd


def test_loss_gets_all_reduce_and_wait():
    cg, gm, ctx = captured_with_ctx(mlp(), 2)
    for p in (propagate_placements, globalize_reductions, propagate_placements):
        gm, _ = p(gm, ctx)
    gm, changed = insert_redistributes(gm, ctx)
    assert changed
    out = gm.graph.output_node()
    loss = out.args[0][gmeta.get_output_roles(out).index("loss")]
    assert "wait_tensor" in str(loss.target)
    assert "all_reduce" in str(loss.args[0].target) and loss.args[0].args[2] == ctx.group_name
    assert placement_of(loss) == Replicate()
    assert not any(gmeta.get_redistribute(n) for n in gm.graph.nodes)


class PerSampleTable(nn.Module):
    """Adds a replicated [B, D] buffer to the batch: needs a rank-local slice."""

    def __init__(self, batch_size):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(batch_size * 4, dtype=torch.float32).view(batch_size, 4) / 10)

    def forward(self, x):
        return self.fc(x) + self.offset


def test_replicated_tensor_is_sliced_to_each_ranks_rows():
    torch.manual_seed(0)
    model = PerSampleTable(5)
    batch = (torch.randn(5, 4), torch.randn(5, 4))
    progs, outs = simulate(model, batch, F.mse_loss, 2)
    slices = [n for n in progs[1].module.graph.nodes if gmeta.get_rank_slice(n) is not None]
    assert slices and slices[0].args[2:] == (3, 5)  # rank 1 holds rows [3, 5)
    hist, _ = eager_sgd(model, [batch], F.mse_loss, 0.1, 1)
    assert abs(float(outs[1][0]) - hist[0][0]) < 1e-6
    for r in range(2):
        torch.testing.assert_close(outs[r][1], hist[0][1]["fc.weight"], atol=1e-6, rtol=1e-5)


def test_constant_added_after_a_batch_sum_is_added_once():
    """sum over the batch is Partial; subtracting a constant must happen after the all_reduce."""

    class SumMinusConst(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x * self.w).sum(0) - 16.0

    model = SumMinusConst()
    batch = (torch.ones(16, 4), torch.zeros(16))
    loss_fn = lambda out, t: (out**2).mean() + 0 * t.sum()  # noqa: E731
    _, outs = simulate(model, batch, loss_fn, 2)
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    assert hist[0][0] == 0.0
    assert [float(o[0]) for o in outs] == [0.0, 0.0]


def test_loss_module_with_class_weights_counts_weights_globally():
    from models import mlp

    model, batch, _ = mlp(7)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0, 0.5, 1.0]))
    progs, outs = simulate(model, batch, loss_fn, 3)
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    assert progs[0].constants  # the class weights are a constant of the program
    for r in range(3):
        assert abs(float(outs[r][0]) - hist[0][0]) < 1e-6
        torch.testing.assert_close(outs[r][1], hist[0][1]["fc1.weight"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,cols,world", [(8, 8, 2), (9, 7, 3), (5, 11, 4), (4, 6, 4)])
def test_shard_to_another_dim_is_an_all_to_all(rows, cols, world):
    """S(1) -> S(0) (and back, for the gradient) by all_to_all, uneven and empty shards included;
    no all_gather: each rank receives only its own block."""
    from models import two_shards
    from test_tensor_parallel import _check

    model, batch, loss_fn = two_shards(3, rows, cols)
    progs = _check(model, batch, loss_fn, world, {"a": "S(1)", "b": "S(0)"})
    kinds = [c.split("(")[0].split(".")[1] for c in progs[0].collectives()]
    assert kinds.count("all_to_all_single") == 2 and "all_gather_into_tensor" not in kinds


def test_slice_of_a_later_dim_feeds_layer_norm_backward_contiguous():
    """R -> S(1) of LayerNorm's saved mean/rstd ([B, T, 1]) is a strided slice, which torch 2.13's CPU
    native_layer_norm_backward reads as if contiguous; the local slice is made contiguous, and the
    gradients (LayerNorm backward split by sequence through a planner hint) equal eager's."""
    import torch.nn as nn
    import torch.nn.functional as F

    from adaptdist.compiler.capture import capture
    from passutil import lower_1d
    from adaptdist.runtime.simulate import simulate_ranks
    from adaptdist.strategy import Strategy

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(32)
            self.w = nn.Parameter(torch.randn(32))

        def forward(self, x):
            return (self.ln(x) * self.w).sum(-1)

    torch.manual_seed(0)
    model, x, y = Norm(), torch.randn(4, 8, 32), torch.randn(4, 8)
    cg = capture(model, (x, y), F.mse_loss)
    state = {f: dict(model.named_parameters())[f].detach() for f in cg.input_fqns}
    hint = Strategy.parse("S(1),S(1),S(1),S(1),R,R->S(1),P(sum),P(sum)")
    progs = lower_1d(cg, 2, mesh_axis="tp", shard_batch=False, state=state,
                     node_strategies={"native_layer_norm_backward": hint})
    from adaptdist.mesh import Mesh

    mesh = Mesh.parse("tp=2")
    assert "torch.ops.aten.clone.default(slice_tensor" in progs[0].module.code
    outs = simulate_ranks([p.module for p in progs.values()],
                          [[p.state[f] for f in p.input_fqns] + list(p.local_batch((x, y))) for p in progs.values()],
                          mesh)
    (loss, grads), = eager_sgd(model, [(x, y)], F.mse_loss, 0.1, 1)[0]
    for r, p in progs.items():
        for f in p.param_fqns:
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")], grads[f], atol=1e-5, rtol=1e-5)


class ViewMeetsPartial(nn.Module):
    """``tanh(h * s + u @ w)``: ``u @ w`` ``[B * T, D]`` is Partial (``u`` sharded on its columns, ``w`` on its
    rows); ``h`` is the batch ``[B, T, D]`` (sharded on B) viewed as ``[B * T, D]``, so rank r holds rows
    ``[T s_r, T e_r)`` of it, ``[s_r, e_r)`` its torch.chunk block of B, not a torch.chunk block of B * T."""

    def __init__(self, batch_size, seq, dim=4, inner=6):
        super().__init__()
        self.u = nn.Parameter(torch.randn(batch_size * seq, inner))
        self.register_buffer("w", torch.randn(inner, dim))
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        b, t, d = x.shape
        return torch.tanh(x.reshape(b * t, d) * self.s + self.u @ self.w).reshape(b, t, d)


def _producers(node):
    """``node`` and everything it is computed from."""
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.append(n)
            todo.extend(n.all_input_nodes)
    return seen


def _check_against_eager(model, batch, world, placements):
    from passutil import local_shard, simulate_plan

    progs, stored, outs = simulate_plan(model, batch, F.mse_loss, world, placements, shard_batch=True)
    (loss, grads), = eager_sgd(model, [batch], F.mse_loss, 0.1, 1)[0]
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, r
        for f in p.param_fqns:
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")],
                                       local_shard(grads[f], stored.get(f), world, r), atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f}")
    return progs


@pytest.mark.parametrize("batch_size,seq,world", [(5, 3, 2), (5, 2, 4), (2, 3, 3)])
def test_partial_to_shard_meeting_a_view_of_a_shard_is_a_reduce_scatter(batch_size, seq, world):
    """P -> S(0) of ``u @ w`` where it meets rows of a viewed batch shard (B = 5 over 2 ranks: rows [0, 9) and
    [9, 15), where torch.chunk of 15 would give [0, 8) and [8, 15); over 4 ranks 4, 4, 2 and 0 rows; B = 2
    over 3 ranks leaves rank 2 empty): a reduce_scatter of ``[B, T, D]`` in torch.chunk blocks of B, viewed
    back; no all_reduce on that path, and loss and gradients equal eager on every rank."""
    torch.manual_seed(0)
    model = ViewMeetsPartial(batch_size, seq)
    batch = (torch.randn(batch_size, seq, 4), torch.randn(batch_size, seq, 4))
    progs = _check_against_eager(model, batch, world, {"u": "S(1)", "w": "S(0)"})
    assert ["add", "mm", "P(sum)", "S(0)", "reduce_scatter_tensor"] in [
        r.as_list() for r in progs[0].plan.lowered.redistributions["tp"]]
    chunk = -(-batch_size // world)
    for r, p in progs.items():
        add = next(n for n in p.module.graph.nodes if n.name == "add")
        kinds = {str(n.target) for n in _producers(add)}
        assert any("reduce_scatter" in k for k in kinds) and not any("all_reduce" in k for k in kinds), (r, kinds)
        rs = next(n for n in p.module.graph.nodes if "reduce_scatter" in str(n.target))
        assert tuple(rs.args[0].meta["val"].shape) == (world * chunk, seq, 4)  # padded torch.chunk blocks of B
        rows = max(0, min(chunk, batch_size - r * chunk)) * seq
        assert tuple(add.meta["val"].shape) == (rows, 4)


def test_forward_reduce_scatter_is_not_bucketed_with_gradients():
    """A forward P -> S reduce_scatter (meeting the sharded batch) beside a gradient's reduce_scatter (``s``,
    stored sharded): bucketing merges only gradients; the forward one stays before its consumer."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.randn(10, 6))
            self.register_buffer("w", torch.randn(6, 4))
            self.s = nn.Parameter(torch.linspace(0.5, 1.5, 4))

        def forward(self, x):
            return torch.tanh(x + self.u @ self.w) * self.s

    torch.manual_seed(0)
    batch = (torch.randn(10, 4), torch.randn(10, 4))
    progs = _check_against_eager(M(), batch, 3, {"u": "S(1)", "w": "S(0)", "s": "S(0)"})
    kinds = [c.split("(")[0].split(".")[1] for c in progs[0].collectives()]
    assert kinds.count("reduce_scatter_tensor") == 2, kinds


class LaterDimViewMeetsReplicated(nn.Module):
    """``tanh(p.view(K, G * T) * x)``: ``p`` ``[K, G, T]`` sharded on G is viewed as ``[K, G * T]``, so rank r
    holds columns ``[T s_r, T e_r)``, ``[s_r, e_r)`` its torch.chunk block of G, not a torch.chunk block of
    G * T; the replicated batch ``x`` ``[K, G * T]`` is sliced on dim 1 (a strided slice, made contiguous)
    to meet it."""

    def __init__(self, k, groups, seq):
        super().__init__()
        self.p = nn.Parameter(torch.randn(k, groups, seq))

    def forward(self, x):
        k, g, t = self.p.shape
        return torch.tanh(self.p.reshape(k, g * t) * x)


@pytest.mark.parametrize("k,groups,seq,world", [(3, 3, 2, 2), (2, 5, 3, 4), (3, 2, 3, 3)])
def test_slice_of_a_later_dim_meeting_a_view_of_a_shard_takes_its_columns(k, groups, seq, world):
    """R -> S(1) of the batch ``x`` meets ``p.view`` (S(1)) whose columns are whole groups: G = 3 over 2 ranks
    with T = 2 gives columns [0, 4) and [4, 6) where torch.chunk of 6 gives [0, 3) and [3, 6); G = 5 over 4
    ranks gives 2, 2, 1 and 0 groups, G = 2 over 3 ranks leaves rank 2 empty. The slice of ``x`` is followed by
    a contiguous clone, which the alignment looks through; loss and gradients equal eager on every rank."""
    from passutil import local_shard, simulate_plan

    torch.manual_seed(0)
    model = LaterDimViewMeetsReplicated(k, groups, seq)
    batch = (torch.randn(k, groups * seq), torch.randn(k, groups * seq))
    progs, stored, outs = simulate_plan(model, batch, F.mse_loss, world, {"p": "S(1)"})
    assert "torch.ops.aten.clone.default(slice_tensor" in progs[0].module.code
    (loss, grads), = eager_sgd(model, [batch], F.mse_loss, 0.1, 1)[0]
    chunk = -(-groups // world)
    for r, p in progs.items():
        mul = next(n for n in p.module.graph.nodes if n.name == "mul")
        assert tuple(mul.meta["val"].shape) == (k, max(0, min(chunk, groups - r * chunk)) * seq), r
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, r
        for f in p.param_fqns:
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")],
                                       local_shard(grads[f], stored.get(f), world, r), atol=1e-5, rtol=1e-5,
                                       msg=f"rank {r} grad {f}")
