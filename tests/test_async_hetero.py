"""``--mode async-hetero`` (adaptdist/hetero_layout.py, adaptdist/runtime/async_hetero.py): the layout, the
one-process schedule against eager PyTorch (staleness 0) and against an independent stale-table reference
(staleness K), and gloo ranks against eager (slow; staleness 2 on gloo ranks: test_recsys_modes.py's train test).
Data: a small generated data set (movielens.generate)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from adaptdist.data import movielens as ml
from adaptdist.runtime.faults import Fault
from adaptdist.errors import RuntimeLaunchError, UsageError
from adaptdist.hetero_layout import HeteroLayout, TableShard, make_layout, parse_dense_ranks, shard_tables
from adaptdist.models import dlrm
from adaptdist.runtime.async_hetero import check_model, dense_slices, simulate
from reference import eager_sgd

LR, STEPS, B = 0.1, 6, 16
SMALL = dlrm.RatingConfig(dim=8, top_hidden=(16,))
SHAPE = dict(num_users=40, num_movies=60, num_genres=6, num_ratings=300, max_genres=3)


def _data():
    return ml.generate(**SHAPE)


def _model(data):
    torch.manual_seed(0)
    return dlrm.rating_model(data.num_users, data.num_movies, data.num_genres, 3.5, SMALL)


def _batches(data, n=STEPS):
    return list(itertools.islice(ml.epoch_batches(data, data.split()[0], B), n))


def _rows(model):
    return [t.weight.shape[0] for t in model.sparse_arch.tables]


# --- the layout -------------------------------------------------------------------------------------------------

def test_tables_go_whole_to_sparse_ranks_when_balanced_else_by_rows():
    shards, how = shard_tables([60, 40, 7], [0, 1])  # 60 | 47: within 1.25 x the mean
    assert how == "table" and {(s.table, s.rank) for s in shards} == {(0, 0), (1, 1), (2, 1)}
    shards, how = shard_tables([9742, 610, 21], [0, 1])  # MovieLens: the movies' table alone outweighs the rest
    assert how == "row"
    assert [(s.table, s.row_start, s.row_end, s.rank) for s in shards if s.table == 0] == [(0, 0, 4871, 0),
                                                                                         (0, 4871, 9742, 1)]
    assert shard_tables([5, 5], [0, 1, 2])[1] == "row"  # fewer tables than ranks
    with pytest.raises(UsageError, match="at least as many tables"):
        shard_tables([5, 5], [0, 1, 2], "table")


def test_the_layout_checks_itself():
    lay = make_layout(3, (2,), [60, 40, 7], 1)
    assert lay.roles == ("sparse", "sparse", "dense") and lay.dense_ranks == (2,)
    assert lay.describe()["roles"] == {"0": "sparse", "1": "sparse", "2": "dense"}
    assert lay.table_rows() == (60, 40, 7)
    with pytest.raises(UsageError, match="at least one sparse and one dense"):
        HeteroLayout(("dense", "dense"), (), "row", 0)
    with pytest.raises(UsageError, match="leaves no sparse rank"):
        make_layout(2, (0, 1), [5], 0)
    with pytest.raises(UsageError, match="rank 3 is not in 0..2"):
        make_layout(3, (3,), [5], 0)
    with pytest.raises(UsageError, match="do not cover"):
        HeteroLayout(("sparse", "dense"), (TableShard(0, 0, 3, 0), TableShard(0, 4, 6, 0)), "row", 0)
    with pytest.raises(UsageError, match="max-staleness"):
        make_layout(2, (1,), [5], -1)
    assert parse_dense_ranks("2,3") == (2, 3)
    with pytest.raises(UsageError, match="distinct"):
        parse_dense_ranks("1,1")
    with pytest.raises(UsageError, match="multiple of the dense ranks"):
        dense_slices(6, 4)  # torch.chunk cuts 6 rows into 3 chunks of 2, not 4
    assert dense_slices(10, 3) == [slice(0, 4), slice(4, 8), slice(8, 10)]


def test_a_model_without_the_two_parts_is_refused():
    with pytest.raises(UsageError, match="sparse_arch.tables"):
        check_model(torch.nn.Linear(2, 2))


# --- the schedule in one process --------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dense,sharding", [(4, (2, 3), None), (4, (3,), "table"), (4, (0,), "row"),
                                                  (2, (1,), None)])
def test_staleness_0_equals_eager(world, dense, sharding):
    """Loss, every gradient and the SGD-updated parameters at each of 6 steps equal single-process eager's, for
    table-wise and row-wise shards and 1 or 2 dense ranks."""
    data = _data()
    model = _model(data)
    batches = _batches(data)
    hist, params = eager_sgd(model, batches, dlrm.rating_loss, LR, STEPS)
    lay = make_layout(world, dense, _rows(model), 0, sharding)
    trained = copy.deepcopy(model)
    res = simulate(trained, dlrm.rating_loss, iter(batches), lay, STEPS, "sgd", LR, record_grads=True)
    for t, ((want_loss, want_grads), loss, grads) in enumerate(zip(hist, res.losses, res.grads)):
        assert loss == pytest.approx(want_loss, abs=1e-5), t
        assert set(grads) == set(want_grads)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=f"step {t}: {name}")
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p, params[name], atol=1e-5, rtol=0, msg=name)


def stale_sgd(model, batches, K: int, lr: float):
    """The reference of staleness K, written apart from the runtime: step t's lookups read the tables as they
    were after the updates of steps 0..t-K-1 (a kept copy), and its gradient updates the current tables."""
    model = copy.deepcopy(model)
    tables = [t.weight for t in model.sparse_arch.tables]
    versions = [[w.detach().clone() for w in tables]]  # versions[j]: after steps 0..j-1
    losses = []
    for t, batch in enumerate(batches):
        stale = copy.deepcopy(model.sparse_arch)
        with torch.no_grad():
            for w, v in zip(stale.tables, versions[max(0, t - K)]):
                w.weight.copy_(v)
        model.dense_arch.zero_grad()
        loss = dlrm.rating_loss(model.dense_arch(stale(*batch[:-1])), batch[-1])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.dense_arch.parameters():
                p -= lr * p.grad
            for w, s in zip(tables, stale.tables):
                w -= lr * s.weight.grad
        versions.append([w.detach().clone() for w in tables])
    return losses, model


@pytest.mark.parametrize("K", [1, 3])
def test_staleness_k_reads_the_tables_of_k_steps_before(K):
    data = _data()
    model = _model(data)
    batches = _batches(data, 8)
    want_losses, want = stale_sgd(model, batches, K, LR)
    lay = make_layout(3, (2,), _rows(model), K, "row")
    trained = copy.deepcopy(model)
    res = simulate(trained, dlrm.rating_loss, iter(batches), lay, 8, "sgd", LR)
    assert res.losses == pytest.approx(want_losses, abs=1e-5)
    for (name, p), q in zip(trained.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    # and it is not the synchronous run: the bound is the schedule's, not a no-op
    sync = simulate(copy.deepcopy(model), dlrm.rating_loss, iter(batches), make_layout(3, (2,), _rows(model), 0),
                    8, "sgd", LR)
    assert max(abs(a - b) for a, b in zip(sync.losses, res.losses)) > 1e-4


def test_adamw_on_shards_equals_adamw_on_whole_tables():
    data = _data()
    model = _model(data)
    batches = _batches(data)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for b in batches:
        opt.zero_grad()
        dlrm.rating_loss(ref(*b[:-1]), b[-1]).backward()
        opt.step()
    trained = copy.deepcopy(model)
    simulate(trained, dlrm.rating_loss, iter(batches), make_layout(3, (1,), _rows(model), 0, "row"), STEPS,
             "adamw", 1e-2)
    for (name, p), q in zip(trained.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


# --- gloo ranks -------------------------------------------------------------------------------------------------

def _gloo(tmp_path, layout, steps, fault=None, timeout_s=60.0):
    from adaptdist.runtime.async_hetero import HeteroConfig, run_rank
    from adaptdist.runtime.launch import launch_local
    from adaptdist.runtime.timeouts import Timeouts
    from adaptdist.runtime.worker import DataSpec

    folder = ml.save(_data(), tmp_path / "ml")
    torch.manual_seed(0)
    model, _, loss_fn = dlrm.factory(B, 1, data_path=str(folder), config=SMALL)
    spec = DataSpec(dlrm.__file__, "data", B, 1, path=str(folder), seed=0)
    cfg = HeteroConfig(model, loss_fn, spec, layout(model), steps, "sgd", LR, timeout_s=timeout_s,
                       record_first_grads=True, fault=fault)
    res = launch_local(run_rank, (cfg,), cfg.layout.world_size, timeouts=Timeouts.for_collective(timeout_s))
    return model, loss_fn, folder, cfg.layout, res


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gloo_ranks_at_staleness_0_equal_eager(tmp_path):
    """1 sparse rank and 2 dense ranks (data parallel) on gloo: the loss of every step, the first step's gradients
    (the dense ones on a dense rank, the tables' on the sparse rank) and the SGD-updated parameters equal eager's."""
    from adaptdist.runtime.async_hetero import assemble

    model, loss_fn, folder, lay, res = _gloo(tmp_path, lambda m: make_layout(3, (1, 2), _rows(m), 0), STEPS)
    batches = list(itertools.islice(dlrm.data(B, 1, path=str(folder)), STEPS))
    hist, params = eager_sgd(model, batches, loss_fn, LR, STEPS)
    for r in (1, 2):
        assert res[r]["losses"] == pytest.approx([h[0] for h in hist], abs=1e-5)
        for name, g in res[r]["first_grads"].items():
            torch.testing.assert_close(g, hist[0][1][name], atol=1e-5, rtol=0, msg=name)
    for key, g in res[0]["first_grads"].items():  # "table{t}.0": the whole table on the one sparse rank
        torch.testing.assert_close(g, hist[0][1][f"sparse_arch.tables.{key[5]}.weight"], atol=1e-5, rtol=0)
    trained = copy.deepcopy(model)
    assemble(trained, lay, {0: res[0]["state"]}, res[1]["state"])
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p, params[name], atol=1e-5, rtol=0, msg=name)
    assert all(res[r]["role"] == role for r, role in enumerate(("sparse", "dense", "dense")))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stalled_sparse_rank_is_named_not_a_hang(tmp_path):
    """A sparse rank that stops answering before step 4: the dense rank's receive fails after the collective
    timeout (10 s) and the error names the stalled rank."""
    with pytest.raises(RuntimeLaunchError) as info:
        _gloo(tmp_path, lambda m: make_layout(2, (1,), _rows(m), 0), STEPS, fault=Fault("stall", 0, 4), timeout_s=10.0)
    text = str(info.value)
    assert "rank 0" in text and "did not arrive" in text, text
