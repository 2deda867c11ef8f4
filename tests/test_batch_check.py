"""Every global batch, not only the first, is checked against the compiled batch before it reaches the programs:
a later batch of another size would train silently wrong (a smaller one: the mean divided by the compiled row
count; a larger one: its first rows only), another sequence length would fail inside a rank's reshape."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch

from adaptdist.errors import DataError
from adaptdist.runtime.batch_check import batch_shapes, checked_batches
from adaptdist.runtime.worker import DataSpec, global_batches, positioned_batches

DATA = """
import torch

def data(batch_size, seq_len, seed=0{start}):
    g = torch.Generator().manual_seed(seed)
    step = {first}
    while True:
        step += 1
        rows, cols = batch_size, seq_len
        if step == {bad_step}:
            rows, cols = {bad}
        yield torch.randn(rows, cols, generator=g), torch.randint(0, 5, (rows, cols), generator=g)
"""


def _spec(tmp_path, bad: str, bad_step: int = 3, start_step: bool = False, shapes: bool = True) -> DataSpec:
    f = tmp_path / f"data_{abs(hash((bad, bad_step, start_step)))}.py"
    f.write_text(DATA.format(start=", start_step=0" if start_step else "", first="start_step" if start_step else 0,
                             bad_step=bad_step, bad=bad))
    example = (torch.zeros(6, 4), torch.zeros(6, 4, dtype=torch.long))
    return DataSpec(str(f), "data", 6, 4, batch_shapes=batch_shapes(example) if shapes else None)


@pytest.mark.parametrize("bad, want", [
    ("batch_size - 1, seq_len", "float32 [5, 4], but the programs were compiled for float32 [6, 4]"),
    ("batch_size + 1, seq_len", "float32 [7, 4], but the programs were compiled for float32 [6, 4]"),
    ("batch_size, seq_len - 2", "float32 [6, 2], but the programs were compiled for float32 [6, 4]"),
])
def test_a_later_batch_of_another_shape_is_refused_naming_the_step(tmp_path, bad, want):
    it = global_batches(_spec(tmp_path, bad))
    next(it), next(it)  # steps 1 and 2 are fine
    with pytest.raises(DataError) as e:
        next(it)
    msg = str(e.value)
    assert "for step 3, batch element 0 as " + want in msg, msg
    assert "--batch-size 6 --seq-len 4" in msg
    if "seq_len -" in bad:
        assert "pad or cut sequences" in msg
    else:
        assert "drop_last=True" in msg and "every batch must have 6 rows" in msg


def test_without_compiled_shapes_later_batches_must_match_the_first(tmp_path):
    it = global_batches(_spec(tmp_path, "batch_size - 1, seq_len", shapes=False))
    next(it), next(it)
    with pytest.raises(DataError, match=r"for step 3, .* \[5, 4\], .*compiled for float32 \[6, 4\] \(the batch of step 1"):
        next(it)


def test_resumed_batches_are_checked_with_the_right_step_numbers(tmp_path):
    # data(start_step=): the first batch drawn is step 6's
    spec = _spec(tmp_path, "batch_size - 1, seq_len", bad_step=7, start_step=True)
    it = positioned_batches(spec, 5, lambda m: None)
    next(it)
    with pytest.raises(DataError, match="for step 7,"):
        next(it)
    # replayed from the start: a bad batch before the resume point is refused while replaying, by its own step
    spec = _spec(tmp_path, "batch_size - 1, seq_len", bad_step=4)
    with pytest.raises(DataError, match="for step 4,"):
        positioned_batches(spec, 5, lambda m: None)


def test_a_wrong_dtype_count_or_non_tensor_is_refused():
    expected = batch_shapes((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))
    cases = [((torch.zeros(2, 3), torch.zeros(2)), "as float32 [2], but the programs were compiled for int64 [2]"),
             ((torch.zeros(2, 3),), "a tuple of 1 elements"),
             ((torch.zeros(2, 3), [0, 1]), "batch element 1 as list")]
    for batch, want in cases:
        it = checked_batches(iter([(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)), batch]),
                             expected, "m.py:data")
        next(it)
        with pytest.raises(DataError, match="for step 2") as e:
            next(it)
        assert want in str(e.value), str(e.value)


def test_good_batches_pass_unchanged(tmp_path):
    spec = _spec(tmp_path, "batch_size, seq_len")
    plain = DataSpec(spec.module_file, "data", 6, 4)
    for a, b in zip(itertools.islice(global_batches(spec), 5), itertools.islice(global_batches(plain), 5)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_run_takes_the_compiled_shapes_from_the_artifacts(tmp_path):
    """``adaptdist run``'s batches are checked against the example batch saved with the artifacts."""
    from safetensors.torch import save_file

    from adaptdist.runtime.run_artifacts import data_spec

    f = _spec(tmp_path, "batch_size, seq_len").module_file
    save_file({"b0": torch.zeros(6, 4), "b1": torch.zeros(6, 4, dtype=torch.long)},
              str(tmp_path / "example_batch.safetensors"))
    spec = data_spec({"batch_size": 6, "seq_len": 4, "model_file": f}, tmp_path, None, 0)
    assert spec.batch_shapes == (((6, 4), "float32"), ((6, 4), "int64"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_refuses_a_smaller_later_batch_on_the_ranks(capfd, tmp_path):
    """End to end (2 ranks): step 2's batch of 5 rows where 6 were compiled fails with the DataError, before any
    step trains on it (it used to train with the mean divided by 6). The error is printed once, naming both
    ranks (each rank and then the launcher used to print it: three times); capfd sees the ranks' stderr too."""
    from adaptdist.cli import main

    f = tmp_path / "small.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F
        def f(batch_size, seq_len):
            torch.manual_seed(0)
            return nn.Linear(4, 3), (torch.randn(batch_size, 4), torch.randn(batch_size, 3)), F.mse_loss
        def data(batch_size, seq_len, seed=0):
            yield torch.randn(batch_size, 4), torch.randn(batch_size, 3)
            while True:
                yield torch.randn(batch_size - 1, 4), torch.randn(batch_size - 1, 3)
    """))
    rc = main(["train", f"{f}:f", "--nproc", "2", "--plan", "dp", "--batch-size", "6", "--steps", "3", "--out",
               str(tmp_path / "out"), "--sample-bytes", "0", "--threads-per-rank", "1"])
    err = capfd.readouterr().err
    assert rc == 2, err
    assert "DataError" in err and "for step 2, batch element 0 as float32 [5, 4]" in err, err
    assert err.count("for step 2, batch element 0") == 1 and "failed: DataError" in err, err
    assert "step 2/3" not in err
