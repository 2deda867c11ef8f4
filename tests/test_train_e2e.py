"""`adaptdist train` end to end: compile, launch 2 gloo ranks, train, checkpoint, sample."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from adaptdist.cli import main

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
SMALL = ["--batch-size", "4", "--seq-len", "16", "--threads-per-rank", "1", "--timeout-s", "60"]


def test_train_builtin_gpt_writes_checkpoint_and_sample(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--steps", "8", "--lr", "3e-3", "--out", str(out), "--sample-bytes", "40", *SMALL])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["ranks"] == 2
    assert summary["last5_mean_loss"] < summary["initial_loss"]
    assert (out / "checkpoint" / ".metadata").is_file()
    weights = load_file(str(out / "model.safetensors"))
    assert "tok_emb.weight" in weights
    assert (out / "programs" / "manifest.json").is_file()
    assert (out / "programs" / "rank1" / "program.py").read_text().startswith("# adaptdist")
    printed = capsys.readouterr()
    assert "sample" in printed.err and len(printed.out.strip()) > 0


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="../shared/data (tinyshakespeare) is not present in this checkout")
def test_train_on_shakespeare(tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "--data", str(SHAKESPEARE), "--steps", "4", "--out", str(out), "--sample-bytes", "0", *SMALL])
    assert rc == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_train_user_model_from_file_with_cluster_yaml(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "def factory(batch_size, seq_len):\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        "    x = torch.randn(batch_size, 8); y = torch.randint(0, 3, (batch_size,))\n"
        "    return model, (x, y), F.cross_entropy\n"
    )
    (tmp_path / "cluster.yaml").write_text(
        "schema_version: 1\nhosts:\n  - {name: localhost, device_kind: cpu, num_devices: 3}\n"
    )
    out = tmp_path / "run"
    rc = main(["train", f"{tmp_path / 'mymodel.py'}:factory", "--cluster", str(tmp_path / "cluster.yaml"),
               "--batch-size", "5", "--seq-len", "1", "--steps", "5", "--optimizer", "sgd", "--lr", "0.5",
               "--out", str(out), "--threads-per-rank", "1"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 3
    assert summary["final_loss"] < summary["initial_loss"]  # the example batch is repeated: it must fit it
