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
@pytest.mark.timeout(400)
def test_train_restarts_and_resumes_async_hetero_from_its_checkpoints(tmp_path, monkeypatch):
    """`adaptdist train --mode async-hetero --max-staleness 0` on 3 gloo ranks (2 sparse, 1 dense), a checkpoint
    every 2 steps: the dense rank killed before step 3 and the job restarted (--max-restarts 1) from step 2; then
    `--resume` onto 2 ranks (another layout) to step 6. The losses of all 6 steps and the final weights equal
    eager PyTorch's (SGD)."""
    from safetensors.torch import load_file

    from adaptdist.cli import main
    from adaptdist.runtime.faults import ENV_VAR
    from reference import eager_sgd

    folder = ml.save(ml.generate(**SHAPE), tmp_path / "ml")
    out = tmp_path / "run"
    monkeypatch.setenv(ENV_VAR, "kill:2:3")
    rc = main(["train", "builtin:dlrm", "--data", str(folder), "--batch-size", str(B), "--nproc", "3", "--steps", "4",
               "--mode", "async-hetero", "--dense-ranks", "2", "--max-staleness", "0", "--optimizer", "sgd",
               "--lr", "0.1", "--checkpoint-every", "2", "--max-restarts", "1", "--out", str(out),
               "--timeout-s", "60"])
    assert rc == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["start_step"] == 2 and first["checkpoints"] == [4] and len(first["losses"]) == 4
    monkeypatch.delenv(ENV_VAR)
    rc = main(["train", "--resume", str(out), "--nproc", "2", "--steps", "6"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["mode"] == "async-hetero" and s["start_step"] == 4 and s["roles"] == {"0": "sparse", "1": "dense"}
    torch.manual_seed(0)
    model, _, loss_fn = dlrm.factory(B, 1, data_path=str(folder))
    batches = list(itertools.islice(dlrm.data(B, 1, path=str(folder)), STEPS))
    hist, params = eager_sgd(model, batches, loss_fn, 0.1, STEPS)
    assert s["losses"] == pytest.approx([h[0] for h in hist], abs=1e-5)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, params[name], atol=1e-5, rtol=0, msg=name)
