"""`adaptdist train` end to end: compile, launch 2 gloo ranks, train, checkpoint, sample."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from adaptdist.cli import main

pytestmark = pytest.mark.slow  # every test here starts ranks (processes)

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
SMALL = ["--batch-size", "4", "--seq-len", "16", "--threads-per-rank", "1", "--timeout-s", "60"]


def _last_dcp(out: Path) -> Path:
    from adaptdist.runtime.checkpoint_store import latest_good

    return latest_good(out / "checkpoints").path / "dcp"


def test_train_builtin_gpt_writes_checkpoint_and_sample(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--steps", "8", "--lr", "3e-3", "--out", str(out), "--sample-bytes", "40", *SMALL])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["ranks"] == 2
    assert summary["last_mean_loss"] < summary["initial_loss"]
    assert (out / "checkpoints" / "step-00000008" / "dcp" / ".metadata").is_file()
    assert json.loads((out / "run.json").read_text())["state"] == "complete" and summary["complete"]
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
    (tmp_path / "helpers.py").write_text("HIDDEN = 16\n")  # a module beside the model file
    (tmp_path / "mymodel.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from helpers import HIDDEN\n"
        "def factory(batch_size, seq_len):\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))\n"
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


def test_dropout_masks_differ_between_ranks(tmp_path):
    """Column means of dropout(ones) over 4 rows: E[loss] = 1 + 1/4 with independent masks, 1 + 2/4 if
    both ranks drew the same masks for their rows."""
    (tmp_path / "drop.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.w = nn.Parameter(torch.ones(20000))\n"
        "    def forward(self, x):\n"
        "        return F.dropout(x * self.w, 0.5, training=True).mean(0)\n"
        "def factory(batch_size, seq_len):\n"
        "    x = torch.ones(batch_size, 20000)\n"
        "    return M(), (x, torch.zeros(batch_size)), lambda out, t: (out ** 2).mean() + 0 * t.sum()\n"
    )
    out = tmp_path / "run"
    rc = main(["train", f"{tmp_path / 'drop.py'}:factory", "--nproc", "2", "--batch-size", "4", "--steps", "1",
               "--out", str(out), "--threads-per-rank", "1", "--optimizer", "sgd"])
    assert rc == 0
    loss = json.loads((out / "summary.json").read_text())["initial_loss"]
    assert abs(loss - 1.25) < 0.05, loss


def test_data_that_runs_out_says_so(tmp_path, capsys):
    (tmp_path / "short.py").write_text(
        "import torch, torch.nn.functional as F\n"
        "def factory(batch_size, seq_len):\n"
        "    return torch.nn.Linear(2, 2), (torch.zeros(batch_size, 2), torch.zeros(batch_size, 2)), F.mse_loss\n"
        "def data(batch_size, seq_len):\n"
        "    for _ in range(2):\n"
        "        yield torch.zeros(batch_size, 2), torch.zeros(batch_size, 2)\n"
    )
    rc = main(["train", f"{tmp_path / 'short.py'}:factory", "--batch-size", "4", "--steps", "3",
               "--out", str(tmp_path / "run"), "--threads-per-rank", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "stopped after 2 batches" in err and "--steps is 3" in err


@pytest.fixture(scope="module")
def dp_on_2_summary(tmp_path_factory) -> dict:
    """summary.json of the dp run on 2 ranks that the fsdp and tp cases below compare with (run once for both)."""
    out = tmp_path_factory.mktemp("dp_on_2") / "dp"
    assert main(["train", "--plan", "dp", "--steps", "3", "--out", str(out), "--sample-bytes", "0", *SMALL]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process load, on purpose
@pytest.mark.parametrize("plan", ["fsdp", "tp", "dp,tp"])
@pytest.mark.timeout(600)  # the first case also builds the shared dp run: 324 s at load 15-20, over the default 300
def test_sharded_plans_train_and_checkpoint_full_tensors(tmp_path, plan, request):
    """The same steps under dp and a sharded plan give the same losses; the DCP checkpoint of
    sharded state loads back as full tensors equal to model.safetensors. dp,tp runs on a 2x2 mesh
    (4 ranks) with gradient clipping on both sides."""
    import torch
    import torch.distributed.checkpoint as dcp

    losses = {}
    if plan != "dp,tp":  # dp on 2 ranks, the same run for fsdp and tp
        losses["dp"] = request.getfixturevalue("dp_on_2_summary")
    for p in [p for p in ("dp", plan) if p not in losses]:
        out = tmp_path / p
        extra = ["--mesh", "dp=2,tp=2", "--max-grad-norm", "0.5"] if p == "dp,tp" else []
        if plan == "dp,tp" and p == "dp":
            extra = ["--nproc", "4", "--max-grad-norm", "0.5"]
        assert main(["train", "--plan", p, "--steps", "3", "--out", str(out), "--sample-bytes", "0", *SMALL,
                     *extra]) == 0
        losses[p] = json.loads((out / "summary.json").read_text())
    assert losses[plan]["initial_loss"] == pytest.approx(losses["dp"]["initial_loss"], abs=1e-5)
    assert losses[plan]["final_loss"] == pytest.approx(losses["dp"]["final_loss"], abs=1e-4)
    full = load_file(str(tmp_path / plan / "model.safetensors"))
    restored = {k: torch.empty_like(v) for k, v in full.items()}
    dcp.load({"model": restored}, checkpoint_id=str(tmp_path / plan / "checkpoints" / "step-00000003" / "dcp"))
    for k, v in full.items():
        assert torch.equal(restored[k], v), k


def test_plan_file(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("schema_version: 1\nmesh_axis: tp\nshard_batch: false\nparams:\n  blocks.*.fc.weight: S(0)\n")
    out = tmp_path / "run"
    assert main(["train", "--plan", str(plan), "--steps", "2", "--out", str(out), "--sample-bytes", "0", *SMALL]) == 0
    header = (out / "programs" / "rank0" / "program.py").read_text().splitlines()[1]
    assert "mesh tp=2" in header


NESTED_MLP = (
    "import torch, torch.nn as nn, torch.nn.functional as F\n"
    "class MLP(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__(); self.fc1 = nn.Linear(12, 7); self.fc2 = nn.Linear(7, 5)\n"
    "    def forward(self, x):\n"
    "        return self.fc2(torch.relu(self.fc1(x)))\n"
    "def factory(batch_size, seq_len):\n"
    "    torch.manual_seed(0)\n"
    "    model = MLP()\n"
    "    x = torch.randn(batch_size, 12); y = torch.randint(0, 5, (batch_size,))\n"
    "    return model, (x, y), F.cross_entropy\n"
)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process load, on purpose
def test_dim_sharded_on_two_axes_trains_and_checkpoints_full_tensors(tmp_path):
    """A plan file sharding fc1's rows (and fc2's columns) on both axes of dp=2,tp=2, dp the batch axis:
    7 rows are chunked by tp (4 | 3), then by dp (2, 2 | 2, 1), not in the mesh's dp-then-tp order. It
    trains like single-process eager SGD (losses and weights), and the DCP checkpoint loads back as full
    tensors equal to model.safetensors."""
    import importlib.util

    import torch
    import torch.distributed.checkpoint as dcp

    from reference import eager_sgd

    (tmp_path / "mlp.py").write_text(NESTED_MLP)
    (tmp_path / "nested.yaml").write_text(
        "schema_version: 2\nmesh: [dp, tp]\nbatch_axis: dp\nparams:\n"
        "  fc1.weight: [S(0), S(0)]\n  fc1.bias: [S(0), S(0)]\n  fc2.weight: [S(1), S(1)]\n")
    assert main(["train", f"{tmp_path / 'mlp.py'}:factory", "--batch-size", "8", "--seq-len", "1", "--steps", "3",
                 "--optimizer", "sgd", "--lr", "0.1", "--threads-per-rank", "1", "--timeout-s", "60",
                 "--plan", str(tmp_path / "nested.yaml"), "--mesh", "dp=2,tp=2", "--out", str(tmp_path / "nested")]) == 0
    spec = importlib.util.spec_from_file_location("nested_mlp", tmp_path / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, batch, loss_fn = module.factory(8, 1)
    history, eager = eager_sgd(model, [batch], loss_fn, 0.1, 3)  # the example batch, repeated
    losses = json.loads((tmp_path / "nested" / "summary.json").read_text())["losses"]
    assert losses == pytest.approx([loss for loss, _ in history], abs=1e-5)
    full = load_file(str(tmp_path / "nested" / "model.safetensors"))
    restored = {k: torch.empty_like(v) for k, v in full.items()}
    dcp.load({"model": restored}, checkpoint_id=str(_last_dcp(tmp_path / "nested")))
    assert full.keys() == eager.keys()
    for k, v in full.items():
        assert torch.equal(restored[k], v), k
        torch.testing.assert_close(v, eager[k], atol=1e-5, rtol=1e-5, msg=k)


SHARED_BATCH_MODELS = {
    "autoencoder_x_x": (
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "def factory(batch_size, seq_len):\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 6))\n"
        "    x = torch.randn(batch_size, 6, generator=torch.Generator().manual_seed(1))\n"
        "    return model, (x, x), F.mse_loss\n"),
    "ids_labels_labels": (
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = nn.Embedding(10, 10); self.b = nn.Embedding(10, 10)\n"
        "    def forward(self, ids, labels):\n"
        "        return self.a(ids) + 0.5 * self.b(labels)\n"
        "def factory(batch_size, seq_len):\n"
        "    torch.manual_seed(0)\n"
        "    ids = torch.randint(0, 10, (batch_size, seq_len), generator=torch.Generator().manual_seed(1))\n"
        "    labels = (ids + 1) % 10\n"
        "    return M(), (ids, labels, labels), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())\n"),
}


@pytest.mark.parametrize("name", sorted(SHARED_BATCH_MODELS))
def test_example_batch_holding_one_tensor_twice_trains_like_eager(tmp_path, name):
    """``(x, x)`` for an autoencoder, ``(ids, labels, labels)``: the example batch is saved (once a raw
    safetensors "Some tensors share memory" traceback) and trained on; 3 SGD steps on 2 ranks give eager's
    losses and parameters."""
    import importlib.util

    import torch

    from reference import eager_sgd

    (tmp_path / f"{name}.py").write_text(SHARED_BATCH_MODELS[name])
    out = tmp_path / "run"
    rc = main(["train", f"{tmp_path / name}.py:factory", "--nproc", "2", "--plan", "dp", "--batch-size", "5",
               "--seq-len", "4", "--steps", "3", "--lr", "0.1", "--optimizer", "sgd", "--sample-bytes", "0",
               "--out", str(out), "--threads-per-rank", "1", "--timeout-s", "60"])
    assert rc == 0
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, batch, loss_fn = module.factory(5, 4)
    history, final = eager_sgd(model, [batch], loss_fn, 0.1, 3)
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses == pytest.approx([loss for loss, _ in history], abs=1e-5)
    weights = load_file(str(out / "model.safetensors"))
    for f, p in final.items():
        torch.testing.assert_close(weights[f], p, atol=1e-5, rtol=1e-5, msg=f)


def test_adamw_has_torch_defaults_and_help_says_so(capsys):
    """``--optimizer adamw`` is torch's AdamW as a user's loop builds it (weight_decay 0.01, not 0)."""
    import torch

    from adaptdist.runtime.worker import make_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    ours = make_optimizer("adamw", [p], 1e-3).defaults
    torchs = torch.optim.AdamW([p], lr=1e-3).defaults
    assert ours == torchs and ours["weight_decay"] == 0.01
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "weight_decay=0.01" in " ".join(capsys.readouterr().out.split())
