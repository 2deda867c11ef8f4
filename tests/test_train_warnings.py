"""``adaptdist train``'s warnings about the user's own inputs: a factory that ignores --batch-size, a loss that is
NaN before any update (the inputs', not the learning rate's fault)."""

from __future__ import annotations

import textwrap

import pytest

from adaptdist.cli import main

MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def factory(batch_size, seq_len, rows=6, bad=False):
        torch.manual_seed(0)
        x = torch.randn(rows, 4)
        if bad:
            x[0, 0] = float("nan")
        return nn.Linear(4, 2), (x, torch.randn(rows, 2)), F.mse_loss

    def fixed_rows(batch_size, seq_len):
        return factory(batch_size, seq_len)

    def nan_input(batch_size, seq_len):
        return factory(batch_size, seq_len, rows=batch_size, bad=True)
""")


def _train(tmp_path, factory: str, capsys) -> str:
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    rc = main(["train", f"{f}:{factory}", "--nproc", "1", "--batch-size", "4", "--steps", "2", "--optimizer", "sgd",
               "--plan", "dp", "--sample-bytes", "0", "--out", str(tmp_path / "run"), "--threads-per-rank", "1"])
    assert rc == 0
    cap = capsys.readouterr()
    return " ".join((cap.out + cap.err).split())


@pytest.mark.timeout(300)
def test_a_factory_that_ignores_batch_size_is_named(tmp_path, capsys):
    out = _train(tmp_path, "fixed_rows", capsys)
    assert "returned an example batch of 6 rows, not --batch-size 4: training on its 6 rows" in out, out


@pytest.mark.timeout(300)
def test_a_nan_loss_at_the_first_step_points_at_the_inputs_not_the_learning_rate(tmp_path, capsys):
    out = _train(tmp_path, "nan_input", capsys)
    assert "the loss became nan at step 1; before any update" in out and "lower --lr" not in out, out
