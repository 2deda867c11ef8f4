"""The throughput unit follows the model: tokens for token ids read by an nn.Embedding, samples otherwise (images,
features, categorical ids in EmbeddingBag tables); the same in the estimate line, the progress line and `run`."""

import textwrap

import pytest
import torch
import torch.nn as nn

from adaptdist.cli import main
from adaptdist.runtime.worker import _Progress
from adaptdist.throughput import manifest_unit, throughput_unit

LM = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 16))
BAGS = nn.EmbeddingBag(16, 4)


@pytest.mark.parametrize("x0,model,want", [
    (torch.randint(0, 16, (8, 32)), LM, ("tokens", 256)),                   # token ids [B, T]
    (torch.randint(0, 16, (8, 32)), None, ("tokens", 256)),                 # no model at hand: ids by their look
    (torch.randn(8, 16), LM, ("samples", 8)),                               # float features
    (torch.randint(0, 255, (8, 3, 4, 4), dtype=torch.uint8), None, ("samples", 8)),  # uint8 images
    (torch.randint(0, 16, (8, 3)), BAGS, ("samples", 8)),                   # categorical ids, no sequence model
    (torch.ones(8, 5, dtype=torch.bool), None, ("samples", 8)),             # a mask
    (torch.randint(0, 16, (8,)), BAGS, ("samples", 8)),                     # dlrm's user ids [B]
])
def test_unit_follows_the_model(x0, model, want):
    assert throughput_unit((x0, torch.zeros(8)), model) == want


def test_compiled_artifacts_keep_the_unit_decided_with_the_model():
    ids = torch.randint(0, 16, (8, 3))
    assert manifest_unit({"throughput_unit": "samples"}, [ids]) == ("samples", 8)
    assert manifest_unit({"throughput_unit": "tokens"}, [ids]) == ("tokens", 24)
    assert manifest_unit({}, [ids]) == ("tokens", 24)  # artifacts from before the field: the batch's look


def test_progress_line_says_samples_per_s(capsys):
    with _Progress(2, enabled=True, unit="samples") as bar:
        bar.update(1, 0.5, 123.0)
    err = capsys.readouterr().err
    assert "123 samples/s" in err and "tok/s" not in err


@pytest.fixture
def image_model_file(tmp_path):
    f = tmp_path / "cnn.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 3, padding=1)
                self.fc = nn.Linear(4 * 8 * 8, 3)

            def forward(self, x):
                return self.fc(torch.relu(self.conv(x.float() / 255)).flatten(1))

        def factory(batch_size, seq_len):
            torch.manual_seed(0)
            g = torch.Generator().manual_seed(1)
            images = torch.randint(0, 256, (batch_size, 3, 8, 8), dtype=torch.uint8, generator=g)
            return Net(), (images, torch.randint(0, 3, (batch_size,), generator=g)), F.cross_entropy
    """))
    return f"{f}:factory"


def test_estimate_of_an_image_model_counts_samples(image_model_file, capsys):
    assert main(["estimate", image_model_file, "--nproc", "2", "--batch-size", "8", "--optimizer", "sgd",
                 "--plan", "dp"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "samples/s" in out and "tokens/s" not in out, out


def test_compile_records_the_unit_for_run(image_model_file, tmp_path, capsys):
    import json

    out = tmp_path / "art"
    assert main(["compile", image_model_file, "--nproc", "2", "--batch-size", "8", "--plan", "dp", "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["throughput_unit"] == "samples"
