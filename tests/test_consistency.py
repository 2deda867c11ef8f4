import pytest
import torch

from adaptdist.compiler.consistency import check_collectives, collective_calls
from adaptdist.compiler.data_parallel import compile_data_parallel
from adaptdist.errors import CollectiveMismatchError
from models import mlp, tiny_gpt


def test_lowered_programs_agree_on_every_collective():
    model, batch, loss_fn = tiny_gpt(5, 8)
    progs = compile_data_parallel(model, batch, loss_fn, 3, bucket_bytes=4096)  # uneven, one rank small
    check_collectives(progs)
    calls = [collective_calls(p) for p in progs.values()]
    assert len(calls[0]) > 3 and all([c.key() for c in cs] == [c.key() for c in calls[0]] for cs in calls)


def test_a_rank_with_a_different_collective_is_refused_naming_both_ranks_and_the_node():
    model, batch, loss_fn = mlp(7)
    progs = compile_data_parallel(model, batch, loss_fn, 2)
    gm = progs[1].module
    ar = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    ar.args = (ar.args[0], ar.args[1], "adaptdist:other")  # as if rank 1 used another group
    with pytest.raises(CollectiveMismatchError) as e:
        check_collectives(progs)
    msg = str(e.value)
    assert "rank 0" in msg and "rank 1" in msg and ar.name in msg and "adaptdist:other" in msg


def test_a_rank_with_a_missing_collective_is_refused():
    model, batch, loss_fn = mlp(7)
    progs = compile_data_parallel(model, batch, loss_fn, 2)
    gm = progs[1].module
    wait = next(n for n in reversed(gm.graph.nodes) if "wait_tensor" in str(n.target))
    ar = wait.args[0]
    wait.replace_all_uses_with(ar.args[0])
    gm.graph.erase_node(wait)
    gm.graph.erase_node(ar)
    with pytest.raises(CollectiveMismatchError, match="would hang"):
        check_collectives(progs)
