"""Checkpoints of ``--mode async-hetero`` (adaptdist/runtime/hetero_checkpoint.py): a run resumed from one equals
the uninterrupted run (K = 0 against the run without checkpoints, which is eager's; K = 1 against the run with
the same checkpoint steps, whose queues drain there too), onto another number of sparse and dense ranks and
another sharding; bad checkpoints are refused by name. One process (simulate), except one slow gloo test of a
rank killed and the job restarted from its checkpoint. Data: a small generated data set (movielens.generate)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

from adaptdist.data import movielens as ml
from adaptdist.errors import CheckpointError
from adaptdist.hetero_layout import make_layout
from adaptdist.models import dlrm
from adaptdist.runtime import checkpoint_store
from adaptdist.runtime.async_hetero import SparseWorker, simulate
from adaptdist.runtime.hetero_checkpoint import check_meta, load_sparse

LR, STEPS, B = 1e-2, 6, 16
SMALL = dlrm.RatingConfig(dim=8, top_hidden=(16,))
SHAPE = dict(num_users=40, num_movies=60, num_genres=6, num_ratings=300, max_genres=3)


def _setup():
    data = ml.generate(**SHAPE)
    torch.manual_seed(0)
    model = dlrm.rating_model(data.num_users, data.num_movies, data.num_genres, 3.5, SMALL)
    batches = list(itertools.islice(ml.epoch_batches(data, data.split()[0], B), STEPS))
    return model, batches


def _rows(model):
    return [t.weight.shape[0] for t in model.sparse_arch.tables]


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_at_staleness_0_onto_other_ranks_equals_the_uninterrupted_run(tmp_path, optimizer):
    """Saved by 2 sparse ranks (rows) + 1 dense rank at step 3, resumed on 3 sparse ranks (tables) + 2 dense ranks:
    the last 3 losses and the final weights (tables, dense part, AdamW's state carried) equal a run without
    checkpoints."""
    model, batches = _setup()
    whole = copy.deepcopy(model)
    ref = simulate(whole, dlrm.rating_loss, iter(batches), make_layout(3, (2,), _rows(model), 0, "row"), STEPS,
                   optimizer, LR)
    first = copy.deepcopy(model)
    simulate(first, dlrm.rating_loss, iter(batches[:3]), make_layout(3, (2,), _rows(model), 0, "row"), 3, optimizer,
             LR, checkpoint_every=3, checkpoint_dir=tmp_path)
    info = checkpoint_store.latest_good(tmp_path)
    assert info is not None and info.step == 3 and info.meta["kind"] == "async-hetero"
    resumed = copy.deepcopy(model)  # the initial weights: everything must come from the checkpoint
    other = make_layout(5, (3, 4), _rows(model), 0, "table")
    out = simulate(resumed, dlrm.rating_loss, iter(batches[3:]), other, STEPS, optimizer, LR, resume_from=info.path,
                   start_step=3)
    assert out.losses == pytest.approx(ref.losses[3:], abs=1e-6)
    _assert_same(resumed, whole)


def test_resume_at_staleness_1_equals_the_run_with_the_same_checkpoints(tmp_path):
    """K = 1: the queues drain at each checkpoint, in the uninterrupted run too, so resuming from step 2 (on
    another layout) equals the run that checkpointed at 2 and 4; and the drain is what differs from a run without
    checkpoints (its weights are not those)."""
    model, batches = _setup()
    lay = make_layout(3, (2,), _rows(model), 1, "row")
    whole = copy.deepcopy(model)
    ref = simulate(whole, dlrm.rating_loss, iter(batches), lay, STEPS, "adamw", LR, checkpoint_every=2,
                   checkpoint_dir=tmp_path / "a")
    assert [s for s, _ in checkpoint_store.list_checkpoints(tmp_path / "a")] == [2, 4, 6]
    resumed = copy.deepcopy(model)
    out = simulate(resumed, dlrm.rating_loss, iter(batches[2:]), make_layout(2, (1,), _rows(model), 1), STEPS,
                   "adamw", LR, checkpoint_every=2, checkpoint_dir=tmp_path / "b",
                   resume_from=checkpoint_store.step_dir(tmp_path / "a", 2), start_step=2)
    assert out.losses == pytest.approx(ref.losses[2:], abs=1e-6)
    _assert_same(resumed, whole)
    undrained = copy.deepcopy(model)
    simulate(undrained, dlrm.rating_loss, iter(batches), lay, STEPS, "adamw", LR)
    diff = max((p - q).abs().max().item() for p, q in zip(undrained.parameters(), whole.parameters()))
    assert diff > 1e-6


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    model, batches = _setup()
    simulate(copy.deepcopy(model), dlrm.rating_loss, iter(batches[:2]), make_layout(2, (1,), _rows(model), 0), 2,
             "adamw", LR, checkpoint_dir=tmp_path)
    info = checkpoint_store.latest_good(tmp_path)
    with pytest.raises(CheckpointError, match="--optimizer adamw, not sgd"):
        check_meta(info.meta, info.path, "sgd", _rows(model), 8)
    with pytest.raises(CheckpointError, match="another model or data set"):
        check_meta(info.meta, info.path, "adamw", [r + 1 for r in _rows(model)], 8)
    with pytest.raises(CheckpointError, match="--mode sync checkpoint"):
        check_meta({"step": 2}, info.path, "adamw", _rows(model), 8)
    # a shard needing rows no saved piece holds (a table longer than the one saved)
    bigger = copy.deepcopy(model)
    bigger.sparse_arch.tables[0] = torch.nn.EmbeddingBag(_rows(model)[0] + 5, 8, mode="mean")
    lay = make_layout(2, (1,), _rows(bigger), 0)
    with pytest.raises(CheckpointError, match="holds no row"):
        load_sparse(info.path, SparseWorker(bigger, lay.shards_of(0), "adamw", LR))
    meta = json.loads((info.path / "meta.json").read_text())
    assert meta["step"] == 2 and len(meta["losses"]) == 2 and meta["layout"]["roles"] == {"0": "sparse", "1": "dense"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gloo_rank_killed_restarts_from_the_checkpoint(tmp_path):
    """3 gloo ranks (2 sparse, 1 dense), K = 0, a checkpoint every 2 steps, the dense rank killed at step 4 and
    the job restarted (--max-restarts 1): it resumes from step 2 and ends with eager's weights and losses."""
    from adaptdist.runtime.async_hetero import HeteroConfig, assemble, run_rank
    from adaptdist.runtime.faults import Fault
    from adaptdist.runtime.launch import launch_local
    from adaptdist.runtime.timeouts import Timeouts
    from adaptdist.runtime.worker import DataSpec
    from reference import eager_sgd

    data = ml.generate(**SHAPE)
    folder = ml.save(data, tmp_path / "ml")
    torch.manual_seed(0)
    model, _, loss_fn = dlrm.factory(B, 1, data_path=str(folder), config=SMALL)
    spec = DataSpec(dlrm.__file__, "data", B, 1, path=str(folder), seed=0)
    lay = make_layout(3, (2,), _rows(model), 0, "row")
    cfg = HeteroConfig(model, loss_fn, spec, lay, STEPS, "sgd", 0.1, timeout_s=60.0, fault=Fault("kill", 2, 4),
                       checkpoint_root=str(tmp_path / "ckpt"), checkpoint_every=2, model_name="builtin:dlrm")
    res = launch_local(run_rank, (cfg,), 3, max_restarts=1, timeouts=Timeouts.for_collective(60.0))
    assert [res[r]["start_step"] for r in range(3)] == [2, 2, 2]
    assert res[2]["checkpoints"] == [4, 6]
    batches = list(itertools.islice(dlrm.data(B, 1, path=str(folder)), STEPS))
    hist, params = eager_sgd(model, batches, loss_fn, 0.1, STEPS)
    assert res[2]["losses"] == pytest.approx([h[0] for h in hist], abs=1e-5)
    trained = copy.deepcopy(model)
    assemble(trained, lay, {0: res[0]["state"], 1: res[1]["state"]}, res[2]["state"])
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p, params[name], atol=1e-5, rtol=0, msg=name)
