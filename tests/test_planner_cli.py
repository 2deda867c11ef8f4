"""`adaptdist plan` with the automatic planner (the default), and `adaptdist explain NODE`."""

from __future__ import annotations

import textwrap

import pytest

from adaptdist.cli import main
from adaptdist.plan import Plan


@pytest.fixture
def model_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        def factory(batch_size, seq_len):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 4))
            return model, (torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))), F.cross_entropy
    """))
    return f"{f}:factory"


@pytest.mark.slow
def test_plan_auto_prints_the_choice_and_saves_a_plan_the_lowering_follows(model_file, tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    assert main(["plan", model_file, "--nproc", "2", "--batch-size", "64", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "automatic plan: mesh" in out and "predicted step" in out and "mesh shapes tried" in out
    assert "parameter placements (per layer pattern)" in out
    plan = Plan.load(out_file)
    assert plan.name == "auto" and plan.node_strategies  # the planner's strategies travel with the plan
    assert plan.lowered is not None and plan.lowered.node_placements  # and, apart, what the lowering did
    assert plan.node_placements and plan.differences() == []  # the lowering followed the planner here
    assert main(["train", model_file, "--plan", str(out_file), "--steps", "2", "--batch-size", "64",
                 "--out", str(tmp_path / "run"), "--sample-bytes", "0"]) == 0


def test_plan_with_a_fixed_mesh(model_file, capsys):
    assert main(["plan", model_file, "--mesh", "dp=2", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "automatic plan: mesh dp=2" in out
    assert "uncalibrated default figures" in " ".join(out.split())  # --nproc/--mesh: no measured figures


def test_explain_lists_alternatives_and_the_reason(model_file, capsys):
    assert main(["explain", "0.weight", model_file, "--nproc", "2", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "strategy (inputs->outputs)" in out and "chosen" in out and "why:" in out
    assert "lowered: " in out and "(as planned)" in out  # what the lowering made of the decision, beside it


def test_explain_unknown_node_suggests_names(model_file, capsys):
    assert main(["explain", "0.wieght", model_file, "--nproc", "2", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "is not a node or parameter" in err and "0.weight" in err


def test_a_plan_that_splits_nothing_says_so(tmp_path, capsys):
    """A model too small to gain from any split: the planner's mesh (named tp=2) shards nothing and replicates the
    batch; the summary says in words that every rank runs the whole step, instead of leaving it to read as tensor
    parallelism."""
    from adaptdist.cli import main

    (tmp_path / "tiny.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "def make(batch_size, seq_len):\n"
        "    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "    return m, (torch.randn(batch_size, 4), torch.randn(batch_size, 2)), F.mse_loss\n")
    # the default --comm (shm estimate): a column-parallel first layer ties with no split (its tiny all_gather
    # prices at about 0), and the ILP's tie-break toward less communication keeps no split
    assert main(["plan", f"{tmp_path / 'tiny.py'}:make", "--batch-size", "8", "--nproc", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "batch replicated" in out and "no split: every rank runs the whole step" in out


def _plan_on(mesh: str, model, batch, loss_fn, comm: str = "gloo"):
    from adaptdist.calibrate.local import local_cluster
    from adaptdist.comm_transport import cluster_for_comm
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner.search import plan_auto
    from adaptdist.mesh import Mesh

    return plan_auto(capture(model, batch, loss_fn), cluster_for_comm(local_cluster(2), comm), mesh=Mesh.parse(mesh))


def test_a_tp_mesh_that_splits_nothing_is_priced_at_twice_dp_compute():
    """tp=2 with no batch axis and nothing split: each rank computes the whole batch, so the predicted compute is
    twice dp=2's (dp splits every node but the few scalar ones); the op overhead (per op, not split) is the same,
    which is why small models show the two meshes' step times close."""
    from adaptdist.compiler.planner.summary import split_nodes
    from models import mlp

    model, batch, loss_fn = mlp(batch_size=64)
    dp = _plan_on("dp=2", model, batch, loss_fn)
    tp = _plan_on("tp=2", model, batch, loss_fn)
    assert not split_nodes(tp.plan) and split_nodes(dp.plan)
    assert 1.99 < tp.predicted.compute_s / dp.predicted.compute_s <= 2.0
    assert tp.predicted.overhead_s == pytest.approx(dp.predicted.overhead_s)


def test_a_tp_mesh_that_shards_only_activations_does_not_say_no_split():
    """builtin:dlrm (generated data) on tp=2: no parameter sharded, the batch replicated, but the dense part's
    activations split over tp (the compute priced halved, the table gradients all-reduced). The summary used to
    say "no split: every rank runs the whole step on the whole batch, with no communication": false here."""
    from rich.console import Console

    from adaptdist.compiler.planner.summary import print_summary, split_nodes
    from adaptdist.model_spec import ModelSpec

    import torch

    torch.manual_seed(0)
    model, batch, loss_fn = ModelSpec.parse("builtin:dlrm").build(256, 1)
    result = _plan_on("tp=2", model, batch, loss_fn, comm="shm")  # the default --comm auto's figures
    assert result.plan.batch_axis is None and sum(result.predicted.communication_s.values()) > 0
    assert all(all(repr(x) == "R" for x in p) for p in result.plan.param_placements.values())
    assert split_nodes(result.plan)
    console = Console(record=True, width=300)
    print_summary(console, result)
    out = " ".join(console.export_text().split())
    assert "no split: every rank runs the whole step" not in out
    assert "no parameter is sharded and the input batch is replicated, but" in out and "split their work over tp" in out


def test_the_table_of_shapes_says_what_each_plan_splits():
    """The built-in GPT on 2 ranks: the planner's tp=2 shape splits every row-wise op's work over tp and shards no
    parameter, which is data parallelism under another axis name, so it is predicted as dp=2 is. The table of
    shapes tried listed the tp=2 row with dp=2's numbers and nothing else, reading as tensor parallelism that
    happened to cost the same; it now says what each row's plan splits."""
    from rich.console import Console

    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner.search import plan_auto
    from adaptdist.compiler.planner.summary import print_summary
    from adaptdist.model_spec import ModelSpec

    import torch

    torch.manual_seed(0)
    model, batch, loss_fn = ModelSpec.parse("builtin:gpt").build(16, 128)  # `adaptdist plan --nproc 2`'s model
    result = plan_auto(capture(model, batch, loss_fn), local_cluster(2))
    by_mesh = {str(c): ev for c, ev in result.tried}
    assert set(by_mesh) == {"dp=2", "tp=2"}
    splits = {str(c): w for c, w in result.splits.items()}
    assert splits["dp=2"] == "batch over dp"
    assert splits["tp=2"].startswith("no parameter sharded on tp: ") and "(as data parallel)" in splits["tp=2"]
    console = Console(record=True, width=300)
    print_summary(console, result)
    rows = [line for line in console.export_text().splitlines() if line.startswith("│ tp=2")]
    assert len(rows) == 1 and "no parameter sharded on tp" in rows[0], rows


def test_one_rank_plans_call_nothing_sharded(model_file, capsys):
    """On one rank (mesh tp=1) every placement holds the whole tensor. The ILP broke a tie toward S(1) there, and
    explain said "2 of 4 replicated on every axis; sharded: 0.weight [S(1)], 2.weight [S(1)]" (plan's table
    tp:S(1), and "split their work over tp"): now Replicate, as the lowering holds them; one "rank 0 holds" column."""
    assert main(["explain", "0.weight", model_file, "--mesh", "tp=1", "--batch-size", "64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "parameters: 4 of 4 replicated on every axis" in out and "sharded:" not in out, out
    assert "split their work over tp" not in out and "S(1)]" not in out
    assert main(["plan", model_file, "--mesh", "tp=1", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "tp:S(" not in out and "tp:R" in out, out
    assert out.count("rank 0 holds") == 1, out
