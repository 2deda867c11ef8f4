import torch

from adaptdist.passes.context import PassContext
from models import convnet, tiny_gpt
from passutil import simulate


def test_torch_chunk_split_with_empty_rank():
    ctx = PassContext(axis_size=3, batch_size=4)
    assert ctx.shard_sizes() == [len(c) for c in torch.arange(4).chunk(3)] + [0] * (3 - len(torch.arange(4).chunk(3)))
    assert ctx.shard_sizes() == [2, 2, 0] and ctx.shard_offsets() == [0, 2, 4]
    assert PassContext(axis_size=2, batch_size=5).shard_sizes() == [3, 2]


def test_each_rank_gets_its_local_shapes():
    model, batch, loss_fn = tiny_gpt(5, 8)
    progs, _ = simulate(model, batch, loss_fn, 2)
    for r, rows in ((0, 3), (1, 2)):
        views = [n for n in progs[r].module.graph.nodes
                 if n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)
                 and n.args[1] and n.args[1][0] == rows * 8]
        assert views, f"rank {r} should view [{rows} * 8, ...]"
        batch_ph = list(progs[r].module.graph.find_nodes(op="placeholder"))[-1]
        assert tuple(batch_ph.meta["val"].shape) == (rows, 8)
        assert f"# i64[{rows}, 8]" in progs[r].code or f'"i64[{rows}, 8]"' in progs[r].code


def test_rank_with_no_rows_runs_and_contributes_nothing():
    model, batch, loss_fn = convnet(3)
    progs, outs = simulate(model, batch, loss_fn, 4)
    assert progs[3].batch_slice == (3, 0)
    losses = {round(float(o[0]), 6) for o in outs}
    assert len(losses) == 1


def test_one_sample_or_one_rank_is_not_split():
    from reference import eager_sgd

    for batch_size, world in ((1, 2), (3, 1)):
        model, batch, loss_fn = tiny_gpt(batch_size, 8)
        progs, outs = simulate(model, batch, loss_fn, world)
        hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
        for r in range(world):
            assert progs[r].batch_slice == (0, batch_size)
            assert progs[r].collectives() == []
            assert abs(float(outs[r][0]) - hist[0][0]) < 1e-5


def test_training_batch_norm_on_one_rank_is_allowed():
    model, batch, loss_fn = convnet(4, batch_norm=True)
    progs, outs = simulate(model, batch, loss_fn, 1)
    assert progs[0].output_roles[0].startswith("buffer:")  # running stats are updated


def test_whole_groups_advice_names_the_axis_and_what_to_change():
    """A shard that does not hold whole groups of a view: on a model axis (heads under tensor parallelism) the
    advice is ranks that divide the heads or another plan (it once said to change the batch size, which does not
    change how the heads split); on the axis that splits the batch, the batch size is part of the answer."""
    from adaptdist.passes.localize_shapes import _whole_groups_advice

    tp = _whole_groups_advice(6, PassContext(axis_size=4, batch_size=8, mesh_axis="tp", shard_batch=False))
    assert tp == ("With tensor parallelism over attention heads the number of ranks on mesh axis 'tp' (4 ranks) must "
                  "divide the number of heads (6 here): use 2 or 3 or 6 ranks there, or a plan that does not shard the "
                  "heads (e.g. --plan dp or fsdp)")
    import torch
    from adaptdist import graph_meta as gmeta

    b = torch.fx.Graph().placeholder("b")
    gmeta.set_role(b, "batch")
    dp = _whole_groups_advice(4, PassContext(axis_size=3, batch_size=8, mesh_axis="dp", shard_batch=True), b)
    assert "mesh axis 'dp' (3 ranks) splits the batch" in dp and "batch size" in dp and "heads" not in dp
    # (hfix9a) a shard the batch axis got from a redistribution, not from the batch: no batch-size advice
    other = _whole_groups_advice(2, PassContext(axis_size=3, batch_size=8, mesh_axis="dp", shard_batch=True))
    assert "not by splitting the batch" in other and "use 2 ranks there" in other and "heads" not in other


def test_whole_groups_advice_names_the_parameter_an_fsdp_axis_sharded():
    """(hfix9a) Under --plan fsdp the dim came from a parameter's dim-0 shard, not from attention heads under
    tensor parallelism: the advice names the parameter, its placement and the axis, and does not talk of heads."""
    import torch
    from adaptdist import graph_meta as gmeta
    from adaptdist.passes.localize_shapes import _whole_groups_advice
    from adaptdist.placement import Shard

    g = torch.fx.Graph()
    w, b = g.placeholder("w"), g.placeholder("b")
    w.meta["val"], b.meta["val"] = torch.empty(48, 16), torch.empty(7, 16)
    gmeta.set_role(w, "param", "mha.in_proj_weight")
    gmeta.set_role(b, "batch")
    gmeta.set_placements(w, (Shard(0),))
    gmeta.set_placements(b, (Shard(0),))
    fsdp = _whole_groups_advice(3, PassContext(axis_size=2, batch_size=7, mesh_axis="dp", shard_batch=True), w)
    assert "parameter 'mha.in_proj_weight' (float32[48, 16]), placed S(0) on mesh axis 'dp' (2 ranks)" in fsdp
    assert "fsdp" in fsdp and "use 3 ranks there" in fsdp and "--plan dp" in fsdp
    assert "heads" not in fsdp and "batch size" not in fsdp
    rows = _whole_groups_advice(4, PassContext(axis_size=3, batch_size=8, mesh_axis="dp", shard_batch=True), b)
    assert "splits the batch" in rows and "batch size" in rows and "parameter" not in rows
