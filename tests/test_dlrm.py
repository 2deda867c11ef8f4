"""builtin:dlrm (adaptdist/models/dlrm.py): the rating model, its factory/data/evaluate contract, its numerics
under dp and the planner's plans on simulated ranks against eager PyTorch, and `adaptdist train builtin:dlrm` on
gloo ranks. The data is the tiny made-up CSVs of test_movielens_data.py; one test reads
../shared/data/movielens-small where it exists."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from adaptdist.data import movielens as ml
from adaptdist.errors import DataError
from adaptdist.model_spec import ModelSpec
from adaptdist.models import dlrm
from passutil import simulated_sgd
from reference import eager_sgd
from test_movielens_data import write_data

LR, STEPS = 0.1, 2
SMALL = dlrm.RatingConfig(dim=8, top_hidden=(16,))


def test_sparse_arch_equals_embedding_bag_mean_with_padding():
    """The weighted sum SparseArch computes for a padded bag equals EmbeddingBag(mode="mean", padding_idx=0):
    output and weight gradient (the padding row gets none)."""
    torch.manual_seed(0)
    arch = dlrm.SparseArch((5, 7), dim=4, padding_idx=(None, 0))
    ref = nn.EmbeddingBag(7, 4, mode="mean", padding_idx=0)
    ref.weight.data.copy_(arch.tables[1].weight.data)
    users = torch.tensor([0, 4, 2])
    bags = torch.tensor([[3, 0, 0], [1, 2, 6], [0, 0, 0]])  # the last bag holds padding only: zeros
    out = arch(users, bags)
    assert out.shape == (3, 2, 4)
    torch.testing.assert_close(out[:, 0], arch.tables[0].weight[users])
    torch.testing.assert_close(out[:, 1], ref(bags))
    assert torch.equal(arch.tables[1].weight[0], torch.zeros(4))
    g = torch.randn(3, 4)
    (out[:, 1] * g).sum().backward()
    (ref(bags) * g).sum().backward()
    torch.testing.assert_close(arch.tables[1].weight.grad, ref.weight.grad)
    assert torch.equal(arch.tables[1].weight.grad[0], torch.zeros(4))


def test_the_factory_sizes_the_model_from_the_data_and_says_which(tmp_path, capsys):
    folder = write_data(tmp_path / "ml")
    model, batch, loss_fn = ModelSpec.parse("builtin:dlrm").build(4, 128, data_path=str(folder))
    rows = [t.weight.shape[0] for t in model.sparse_arch.tables]
    assert rows == [3, 4, 7]  # 3 users, 4 movies, 6 genres + the padding row
    users, movies, genres, ratings = batch
    assert users.shape == (4,) and genres.shape == (4, 3) and ratings.dtype == torch.float32
    loss = loss_fn(model(*batch[:-1]), ratings)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    err = capsys.readouterr().err
    assert f"builtin:dlrm data: {folder}" in err and "8 ratings, 2 steps per epoch at --batch-size 4" in err
    data = ml.load(folder)
    assert model.dense_arch.top[-1].bias.item() == pytest.approx(data.ratings[data.split()[0]].mean().item())
    with pytest.raises(DataError, match="--batch-size 9 is larger than the 8 training ratings"):
        dlrm.factory(9, 1, data_path=str(folder))


def test_data_batches_match_the_example_batch_and_are_checked(tmp_path):
    from adaptdist.runtime.batch_check import batch_shapes
    from adaptdist.runtime.worker import DataSpec, global_batches

    folder = write_data(tmp_path / "ml")
    _, example, _ = dlrm.factory(4, 1, data_path=str(folder))
    spec = DataSpec(dlrm.__file__, "data", 4, 1, path=str(folder), seed=0, batch_shapes=batch_shapes(example))
    batches = global_batches(spec)
    for _ in range(5):  # past the first epoch
        assert batch_shapes(next(batches)) == batch_shapes(example)
    wrong = DataSpec(dlrm.__file__, "data", 4, 1, path=str(folder), seed=0,
                     batch_shapes=batch_shapes((example[0], example[1], example[2][:, :2], example[3])))
    with pytest.raises(DataError, match="step 1, batch element 2 as int64"):
        next(global_batches(wrong))


def test_evaluate_gives_the_validation_rmse(tmp_path):
    folder = write_data(tmp_path / "ml")
    torch.manual_seed(0)
    model, _, _ = dlrm.factory(4, 1, data_path=str(folder), config=SMALL)
    fields, line = dlrm.evaluate(model, path=str(folder), batch_size=4, steps=6)
    data = ml.load(folder)
    train, val = data.split()
    with torch.no_grad():
        users, movies, genres, ratings = data.rows(val)
        want = ((model(users, movies, genres) - ratings) ** 2).mean().sqrt().item()
        base = ((ratings - data.ratings[train].mean()) ** 2).mean().sqrt().item()
    assert fields["validation_rmse"] == pytest.approx(want, rel=1e-6)
    assert fields["mean_baseline_rmse"] == pytest.approx(base, rel=1e-6)
    assert fields["validation_ratings"] == 2 and fields["epochs"] == 3.0
    assert f"validation RMSE {want:.4f} on the latest 2 ratings after 3.00 epochs" in line
    json.dumps(fields)  # goes into summary.json


def _model_and_batch(folder, batch_size: int = 8):
    torch.manual_seed(0)
    model, batch, loss_fn = dlrm.factory(batch_size, 1, data_path=str(folder), config=SMALL)
    return model, batch, loss_fn


def _assert_equal_eager(model, batch, loss_fn, hist, params, atol=1e-5):
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, LR, STEPS)
    for (gl, gg), (wl, wg) in zip(hist, want_hist):
        assert abs(gl - wl) < atol, (gl, wl)
        for f in wg:
            torch.testing.assert_close(gg[f], wg[f], atol=atol, rtol=0, msg=f)
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=atol, rtol=0, msg=f)


@pytest.mark.parametrize("plan", ["dp", "auto"])
def test_dp_and_the_planners_plan_equal_eager(tmp_path, plan):
    """Loss, every gradient and the SGD-updated parameters on 2 simulated ranks equal eager's; under dp the ids
    stay split with the batch (only the loss and the gradients are all-reduced: no lookup on the whole batch)."""
    model, batch, loss_fn = _model_and_batch(write_data(tmp_path / "ml"))
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, 2, plan, LR, STEPS)
    _assert_equal_eager(model, batch, loss_fn, hist, params)
    if plan == "dp":
        assert all("all_reduce" in c for c in progs[0].collectives()), progs[0].collectives()


def test_a_movie_table_that_does_not_fit_is_sharded_and_equals_eager(tmp_path):
    """On devices too small to hold every table whole, the planner shards the largest (the movies'); the programs
    still equal eager."""
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster
    from adaptdist.placement import Shard

    rows = [(u % 5 + 1, 1000 + m, f"{1 + (u + m) % 9 / 2}", u * 40 + m) for u in range(5) for m in range(0, 400, 20)]
    movies = "movieId,title,genres\n" + "".join(f"{1000 + m},Movie {m},{'Drama|Comedy' if m % 2 else 'War'}\n"
                                                  for m in range(400))
    model, batch, loss_fn = _model_and_batch(write_data(tmp_path / "ml", rows, movies))
    assert model.sparse_arch.tables[1].weight.shape == (400, 8)
    roomy = plan_auto(capture(model, batch, loss_fn), FixedCluster.uniform([("localhost", 2)], "cpu")).plan
    assert "sparse_arch.tables.1.weight" not in roomy.param_placements  # fits: replicated
    small = FixedCluster.uniform([("localhost", 2)], "cpu", memory_bytes=70_000)
    tight = plan_auto(capture(model, batch, loss_fn), small).plan
    placement = tight.param_placements["sparse_arch.tables.1.weight"]
    assert any(isinstance(p, Shard) for p in placement), placement
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, 2, tight, LR, STEPS)
    assert progs[0].state["sparse_arch.tables.1.weight"].numel() < 400 * 8  # each rank holds a part
    _assert_equal_eager(model, batch, loss_fn, hist, params)


def test_train_refuses_bad_data_before_starting_ranks(tmp_path, capsys):
    from adaptdist.cli import main

    folder = write_data(tmp_path / "ml", movies="movieId,title,genres\n10,A,Drama\n")
    rc = main(["train", "builtin:dlrm", "--data", str(folder), "--out", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "DataError" in err and f"{folder / 'ratings.csv'}:3: movieId 20 is out of range" in err
    assert not (tmp_path / "run" / "programs").exists()


@pytest.mark.parametrize("command", [["plan"], ["estimate"], ["explain", "addmm"]])
def test_plan_estimate_and_explain_size_the_model_from_data(tmp_path, capsys, command):
    from adaptdist.cli import main

    folder = write_data(tmp_path / "ml", movies="movieId,title,genres\n10,A,Drama\n")
    assert main([*command, "builtin:dlrm", "--data", str(folder)]) != 0
    assert f"{folder / 'ratings.csv'}:3: movieId 20 is out of range" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_builtin_dlrm_on_two_gloo_ranks_writes_the_validation_rmse(tmp_path, capsys):
    from adaptdist.cli import main

    folder = write_data(tmp_path / "ml")
    out = tmp_path / "run"
    rc = main(["train", "builtin:dlrm", "--data", str(folder), "--batch-size", "4", "--steps", "4", "--plan", "dp",
               "--optimizer", "sgd", "--lr", "0.05", "--out", str(out), "--threads-per-rank", "1",
               "--timeout-s", "60"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 4 and summary["plan"] == "dp"
    assert "samples_per_s" in summary and all(math.isfinite(v) for v in summary["losses"])
    ev = summary["evaluation"]
    assert ev["validation_ratings"] == 2 and ev["epochs"] == 2.0 and ev["data"] == str(folder)
    # the trained weights, evaluated here, give the RMSE the run wrote
    from safetensors.torch import load_file

    model, _, _ = dlrm.factory(4, 1, data_path=str(folder))
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    assert dlrm.evaluate(model, str(folder))[0]["validation_rmse"] == pytest.approx(ev["validation_rmse"], rel=1e-6)
    err = capsys.readouterr().err
    assert f"builtin:dlrm data: {folder}" in err and "evaluation: validation RMSE" in err and "samples/s" in err
    assert " sample " not in err  # no text sample (the GPT's rule "─── sample ───") for a recommender


SHARED = ml.DEFAULT_DIR


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} (MovieLens ml-latest-small, ../shared/data beside the "
                                                "project) is not present in this checkout")
def test_movielens_small_loads_splits_and_builds_the_model():
    data = ml.resolve(None)
    assert not data.generated and data.source == str(SHARED)
    counts = (len(data), data.num_users, data.num_movies, data.num_genres, data.max_genres)
    assert counts == (100_836, 610, 9742, 20, 10)
    train, val = data.split()
    assert (len(train), len(val)) == (80_669, 20_167)
    assert data.timestamps[train].max() <= data.timestamps[val].min()
    torch.manual_seed(0)
    model, batch, loss_fn = dlrm.factory(256, 1)
    assert [t.weight.shape[0] for t in model.sparse_arch.tables] == [610, 9742, 21]
    assert math.isfinite(loss_fn(model(*batch[:-1]), batch[-1]).item())


def test_a_model_files_evaluate_that_fails_is_a_warning_not_a_failed_run():
    """train calls a model file's evaluate() after the run finished: a user's function of that name with another
    contract leaves the run complete, without an evaluation, and says why."""
    import argparse
    import io

    from rich.console import Console

    from adaptdist.cli.train import _call_evaluate

    args = argparse.Namespace(model="my.py:factory", data="d", batch_size=4, steps=6)
    text = io.StringIO()
    console = Console(file=text, width=200)
    got = _call_evaluate(lambda model, path, steps: ({"k": path, "s": steps}, "line"), None, args, console)
    assert got == ({"k": "d", "s": 6}, "line")  # only the keywords it takes
    assert _call_evaluate(lambda model, loader: 0.5, None, args, console) is None  # another contract: TypeError
    assert _call_evaluate(lambda model: 0.5, None, args, console) is None  # another return value
    assert _call_evaluate(lambda model: ({"x": object()}, "line"), None, args, console) is None
    out = text.getvalue()
    assert "raised TypeError" in out and "must return (fields: dict, line: str), got float" in out
    assert "cannot be written as JSON" in out


def test_compile_takes_data_and_run_refuses_data_of_other_table_sizes(tmp_path, capsys):
    """`adaptdist compile --data A` sizes the tables from A and records it; `adaptdist run DIR --data B` whose ids
    need other table rows is a UsageError naming the table, both shapes and the command (it was a raw index
    error inside a rank)."""
    from adaptdist.cli import main
    from adaptdist.runtime.run_artifacts import check_data_fits

    small = write_data(tmp_path / "small")
    other = ml.save(ml.generate(num_users=9, num_movies=12, num_genres=4, num_ratings=60, max_genres=2),
                    tmp_path / "other")
    art = tmp_path / "art"
    assert main(["compile", "builtin:dlrm", "--data", str(small), "--batch-size", "4", "--nproc", "2", "--plan", "dp",
                 "-o", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["data"] == str(small) and manifest["param_shapes"]["sparse_arch.tables.0.weight"] == [3, 32]
    check_data_fits(manifest, art, str(small))  # the compile's own data: fine
    capsys.readouterr()
    rc = main(["run", str(art), "--data", str(other), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "UsageError" in err
    assert "sparse_arch.tables.0.weight of shape [9, 32]" in err and "with shape [3, 32]" in err
    assert f"adaptdist compile builtin:dlrm --data {other}" in err
    assert not (tmp_path / "run" / "run.json").exists()
