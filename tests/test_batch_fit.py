"""adaptdist/cli/batch_fit.py: when a model file's data() and its factory's example batch differ, the error names
the function whose batch the model does not take (issue 14), through cli.common.check_first_batch as
``adaptdist train`` calls it (no training: the check runs before the compile)."""

import importlib.util
import textwrap

import pytest
import torch

from adaptdist.cli.common import check_first_batch
from adaptdist.errors import DataError, UsageError
from adaptdist.model_spec import ModelSpec
from adaptdist.runtime.batch_check import batch_shapes
from adaptdist.runtime.worker import DataSpec

MLP_FILE = """
import torch
import torch.nn.functional as F

EXAMPLE_FEATURES, DATA_FEATURES, DATA_ROWS = {example}, {data}, {rows}


def factory(batch_size, seq_len):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    return model, (torch.randn(batch_size, EXAMPLE_FEATURES), torch.randint(0, 4, (batch_size,))), F.cross_entropy


def data(batch_size, seq_len, path=None):
    g = torch.Generator().manual_seed(1)
    while True:
        rows = DATA_ROWS or batch_size
        yield torch.randn(rows, DATA_FEATURES, generator=g), torch.randint(0, 4, (rows,), generator=g)
"""


def _check(tmp_path, text: str, batch_size: int = 6, seq_len: int = 16):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(text))
    spec = ModelSpec.parse(f"{path}:factory")
    model, example, loss_fn = spec.build(batch_size, seq_len)
    data = DataSpec(str(spec.file), "data", batch_size, seq_len, batch_shapes=batch_shapes(example))
    before = {n: b.clone() for n, b in model.named_buffers()}
    try:
        check_first_batch(data, example, model, loss_fn, spec.text)
    finally:
        for n, b in model.named_buffers():  # the step run to find the culprit changes no buffer
            assert torch.equal(b, before[n]), n


def test_an_example_batch_the_model_does_not_take_names_the_factory(tmp_path):
    with pytest.raises(UsageError) as e:
        _check(tmp_path, MLP_FILE.format(example=7, data=8, rows=0))
    text = str(e.value)
    assert "the example batch of" in text and "model.py:factory does not fit the model" in text
    assert "mat1 and mat2 shapes cannot be multiplied (6x7 and 8x16)" in text
    assert "the example batch is [float32 [6, 7], int64 [6]]" in text
    assert "model.py:data() yields [float32 [6, 8], int64 [6]], which the model takes" in text


def test_a_data_batch_the_model_does_not_take_stays_a_data_error_and_says_so(tmp_path):
    with pytest.raises(DataError) as e:
        _check(tmp_path, MLP_FILE.format(example=8, data=9, rows=0))
    text = str(e.value)
    assert "model.py:data yielded, for step 1, batch element 0 as float32 [6, 9]" in text
    assert "the model takes the example batch of" in text and "but not" in text and "mat1 and mat2" in text
    # both batches run (another number of rows): the data error as it was, no blame added
    with pytest.raises(DataError) as e:
        _check(tmp_path, MLP_FILE.format(example=8, data=8, rows=4))
    assert "every batch must have 6 rows" in str(e.value) and "the model takes" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_hugging_face_example_longer_than_the_model_takes_names_the_factory(tmp_path):
    """BERT from a config (16 positions): the factory's example has 20 tokens per row, data() yields 16."""
    text = """
    import torch
    import torch.nn.functional as F
    from transformers import BertConfig, BertForMaskedLM


    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertForMaskedLM(BertConfig(vocab_size=31, hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=2,
                                                   max_position_embeddings=16))

        def forward(self, ids):
            return self.bert(input_ids=ids).logits


    def loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())


    def factory(batch_size, seq_len):
        torch.manual_seed(0)
        ids = torch.randint(0, 31, (batch_size, 20))
        return Bert(), (ids, ids), loss


    def data(batch_size, seq_len, path=None):
        while True:
            ids = torch.randint(0, 31, (batch_size, seq_len))
            yield ids, ids
    """
    with pytest.raises(UsageError) as e:
        _check(tmp_path, text, batch_size=2, seq_len=16)
    msg = str(e.value)
    assert "model.py:factory does not fit the model" in msg and "the example batch is [int64 [2, 20], int64 [2, 20]]" in msg
    assert "data() yields [int64 [2, 16], int64 [2, 16]], which the model takes" in msg
