"""relax_views: view / _unsafe_view become reshape once the graph has collectives, and only then."""

import torch

from adaptdist.passes.relax_views import relax_views
from models import mlp, tiny_gpt
from passutil import assert_untouched, apply_pass, check_mesh_against_eager, collective_nodes, fsdp_placements, lowered_until

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default)


def _count(gm, targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def test_views_become_reshapes_after_collectives_are_inserted():
    model, batch, loss_fn = tiny_gpt(4, 8)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 2, fsdp_placements(model), stop_before="relax_views")
    views, reshapes = _count(gm, VIEWS), _count(gm, (aten.reshape.default,))
    assert views > 0 and collective_nodes(gm, "all_gather")
    names = [n.name for n in gm.graph.nodes]
    gm, changed = apply_pass(relax_views, gm, ctx)
    assert changed
    assert _count(gm, VIEWS) == 0 and _count(gm, (aten.reshape.default,)) == reshapes + views
    assert [n.name for n in gm.graph.nodes] == names  # retargeted in place: same nodes, same order


def test_untouched_without_collectives():
    model, batch, loss_fn = mlp(7)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 1, stop_before="relax_views")  # one rank: no collectives
    assert not any(collective_nodes(gm, k) for k in ("all_reduce", "all_gather", "reduce_scatter"))
    views = _count(gm, VIEWS)
    assert views > 0
    gm = assert_untouched(relax_views, gm, ctx)
    assert _count(gm, VIEWS) == views


def test_fsdp_programs_with_relaxed_views_equal_eager():
    """The gathered parameters feed views that captured strides would reject; reshape keeps the numbers."""
    model, batch, loss_fn = tiny_gpt(4, 8)
    progs = check_mesh_against_eager(model, batch, loss_fn, "dp=2", "fsdp")
    assert _count(progs[0].graph_module, VIEWS) == 0
