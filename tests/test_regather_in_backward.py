"""regather_in_backward: a parameter gathered in forward and used again in backward is gathered again
right before its first backward use (FSDP's reshard-after-forward)."""

from adaptdist import graph_meta as gmeta
from adaptdist.passes.regather_in_backward import regather_in_backward
from models import tiny_gpt
from passutil import assert_untouched, apply_pass, check_mesh_against_eager, collective_nodes, fsdp_placements, lowered_until, loss_position



def _gathered_params(gm, group):
    """{full value node: its gather chain nodes} for every parameter all_gather chain."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = {}
    for n in gm.graph.nodes:
        chain = gmeta.get_gather_chain(n, group)
        if chain and chain[0] in by_name:
            src = by_name[chain[0]].args[0]
            while src.op == "call_function":
                src = src.args[0]
            if src.op == "placeholder" and gmeta.get_role(src) == "param":
                out[n] = [by_name[c] for c in chain]
    return out


def test_parameters_used_in_backward_are_gathered_again_after_the_loss():
    model, batch, loss_fn = tiny_gpt(4, 8)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 2, fsdp_placements(model), stop_before="regather_in_backward")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss_pos = loss_position(gm)
    fulls = _gathered_params(gm, ctx.group_name)
    both = [f for f in fulls if any(order[u] > loss_pos for u in f.users) and any(order[u] <= loss_pos for u in f.users)]
    assert both  # the linear weights feed forward matmuls and their backward
    n_gathers = len(collective_nodes(gm, "all_gather"))
    gm, changed = apply_pass(regather_in_backward, gm, ctx)
    assert changed
    assert len(collective_nodes(gm, "all_gather")) == n_gathers + len(both)  # one more gather per such parameter
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss_pos = loss_position(gm)
    for full in both:
        assert all(order[u] <= loss_pos for u in full.users), full  # the forward copy dies in forward
    late_gathers = [g for g in collective_nodes(gm, "all_gather") if order[g] > loss_pos]
    assert len(late_gathers) >= len(both)


def test_untouched_when_no_parameter_is_gathered():
    model, batch, loss_fn = tiny_gpt(4, 8)
    _, gm, ctx = lowered_until((model, batch, loss_fn), 2, stop_before="regather_in_backward")  # dp: replicated
    gm = assert_untouched(regather_in_backward, gm, ctx)


def test_fsdp_programs_with_regathers_equal_eager():
    model, batch, loss_fn = tiny_gpt(4, 8)
    progs = check_mesh_against_eager(model, batch, loss_fn, "dp=2", "fsdp")
    # the parameters (4 MiB buckets: all of them in one) are gathered once in forward and again in backward
    assert sum("all_gather" in c for c in progs[0].collectives()) == 2
