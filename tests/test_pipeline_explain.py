"""``adaptdist explain`` in a chosen pipeline plan (issue 15, point 1): the node is explained by the intra-stage ILP
of the stage that holds it (its layer range, sub-mesh and ranks), not by the whole graph's ILP, beside the
stage-level choice (schedule, microbatches)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptdist.cli import main
from adaptdist.calibrate.local import local_cluster
from adaptdist.compiler.capture import capture
from adaptdist.compiler.planner.stage_explain import explain_in_stage
from adaptdist.compiler.planner.stages import fqn_placements, plan_pipeline
from adaptdist.errors import UsageError
from adaptdist.mesh import Mesh
from adaptdist.placement import Replicate

from models import tiny_gpt

MODEL = str(Path(__file__).parent / "models.py") + ":tiny_gpt"


def test_each_parameter_is_explained_by_its_own_stages_ilp():
    model, example, loss_fn = tiny_gpt(8, 8)
    captured = capture(model, example, loss_fn)
    cluster = local_cluster(4)
    choice = plan_pipeline(captured, cluster, optimizer="sgd", uniform=True, submesh=Mesh.parse("tp=2"),
                           num_stages=2, microbatches=[2], schedules=("1f1b",))  # one search: seconds
    assert [s.source for s in choice.stages] == ["ilp", "ilp"]
    from adaptdist.compiler.planner.graph import build_planning_graph
    from adaptdist.compiler.planner.layers import build_layers

    pg = build_planning_graph(captured, cluster)
    lg = build_layers(pg)
    checked = 0
    for st in choice.stages:
        planned = dict(fqn_placements(lg, st.layer_range[0], st.param_placements))
        first = lg.names.index(st.layers[0])
        for layer in [n for n in st.layers if n.startswith("blocks.")][:1]:  # one block per stage: a re-solve each
            for fqn in lg.layers[lg.names.index(layer)].param_fqns[:3]:
                if fqn == "tok_emb.weight" and st.index > 0:
                    continue  # tied: the first stage holding it places it
                ex = explain_in_stage(captured, cluster, choice, fqn, optimizer="sgd", pg=pg)
                assert ex.stage.index == st.index and ex.stage.ranks == st.ranks
                assert ex.layer_range == (first, first + len(st.layers)) and ex.mesh == {"tp": 2}
                (ax,) = ex.axes
                assert ax.axis == "tp"
                chosen = [a for a in ax.alternatives if a.chosen]
                assert len(chosen) == 1 and len(ax.alternatives) > 1
                # the explained choice is the stage's decision the plan carries (sharded ones listed, else R)
                want = planned.get(fqn, (Replicate(),))[0]
                assert chosen[0].strategy.split("->")[-1] == repr(want), (fqn, ax.alternatives, want)
                assert chosen[0].allowed and ax.reason
                checked += 1
    assert checked == 6
    with pytest.raises(UsageError, match="did you mean"):
        explain_in_stage(captured, cluster, choice, "blocks.1.fc.weigth", pg=pg)
    one = plan_pipeline(captured, local_cluster(2), optimizer="sgd", uniform=True, submesh=Mesh.one_axis("dp", 1),
                        microbatches=[2], schedules=("1f1b",))
    ex = explain_in_stage(captured, local_cluster(2), one, "blocks.1.fc.weight")
    assert ex.axes == [] and "one rank" in ex.why_no_ilp and ex.stage.ranks == (ex.stage.index,)


def test_explain_mesh_pp_names_the_stage_and_its_decision(capsys):
    assert main(["explain", "blocks.1.fc.weight", MODEL, "--batch-size", "8", "--seq-len", "8", "--mesh",
                 "pp=2,tp=2", "--optimizer", "sgd", "--schedule", "1f1b"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pipeline plan: 2 stages, schedule 1f1b" in out
    assert "blocks.1.fc.weight (" in out and "held by stage 1: layers" in out and "ranks [2, 3], sub-mesh tp=2" in out
    assert "the stage's intra-stage ILP decision" in out and "the stage-level choice: schedule 1f1b" in out
    assert "on stage 1's mesh axis tp (2 ranks)" in out and "chosen" in out and "why:" in out
    assert "on mesh axis" not in out.replace("stage 1's mesh axis", "")  # not the whole graph's ILP


WIDE_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Wide(nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def wide(batch_size=128, seq_len=8):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(batch_size, 2048, generator=g) for _ in range(2))
    return Wide(2048, 4), (x, y), F.mse_loss
'''

DEVICE = ("{rank: %d, kind: cpu, cores: 16.0, peak_flops: {float32: 1.0e+12}, memory_bytes: 64000000000, "
          "memory_bandwidth_bytes_per_s: 4.0e+10, op_overhead_s: 5.0e-6}")


def _slow_link_cluster(path: Path, hosts: list[list[int]]) -> Path:
    """Hosts joined by a 100 MB/s link (fast inside a host): the gradient all-reduce of a 4 x 2048^2 MLP costs
    more than sending its activations between stages, so --consider-pp picks a pipeline across the hosts."""
    lines = ["schema_version: 2", "hosts:"]
    for h, ranks in enumerate(hosts):
        lines += [f"  - name: h{h}", "    devices:"] + [f"      - {DEVICE % r}" for r in ranks]
    lines += ["links:", "  - {tier: intra_host, bandwidth_bytes_per_s: 2.0e+10, latency_s: 1.0e-5}",
              "  - {tier: inter_host, bandwidth_bytes_per_s: 1.0e+8, latency_s: 1.0e-4}", "calibration: null"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_consider_pp_where_the_pipeline_wins_says_so_and_explains_from_the_stage(tmp_path, capsys):
    """explain/plan --consider-pp on a case the pipeline wins (2 hosts of 1 rank, slow link): the headline names the
    pipeline and its step, and the SPMD figures as the best plan *without stages* (it printed "mesh pp=2, batch
    replicated; predicted step <the SPMD plan's> ... communication dp ..." before); parameters are on their stage,
    not "pp:R" / "replicated on every axis"; the node is explained in its stage."""
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    model = str(tmp_path / "wide.py") + ":wide"
    cluster = str(_slow_link_cluster(tmp_path / "c.yaml", [[0], [1]]))
    assert main(["explain", "blocks.1.fc.weight", model, "--cluster", cluster, "--consider-pp",
                 "--batch-size", "128"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "automatic plan: pipeline on mesh pp=2 (the stages below), predicted step" in out
    assert "the best plan without stages: mesh dp=2" in out and "the pipeline is chosen" in out
    assert "mesh pp=2, batch replicated" not in out and "replicated on every axis" not in out
    assert "parameters: each on the stage that holds its layer (stage 0: 4, stage 1: 4)" in out
    # the layer range named as `plan` names it (explain said "layers 0..1 (blocks.0 .. blocks.1)")
    assert "held by stage 0: layers blocks.0 .. blocks.1 (2), ranks [0]" in out
    assert "the stage-level choice: schedule" in out
    assert main(["plan", model, "--cluster", cluster, "--consider-pp", "--batch-size", "128"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers blocks.0 .. blocks.1 (2), ranks [0]" in " ".join(out.split())
    assert "pp:R" not in out and "stage, placement in its sub-mesh" in out
    rows = [" ".join(ln.replace("│", " ").split()) for ln in out.splitlines() if "blocks.*.fc" in ln]
    assert sorted(rows) == ["blocks.*.fc.bias stage 0 2", "blocks.*.fc.bias stage 1 2",
                            "blocks.*.fc.weight stage 0 2", "blocks.*.fc.weight stage 1 2"]


@pytest.mark.slow
def test_consider_pp_on_two_hosts_of_two_explains_from_the_stages_ilp(tmp_path, capsys):
    """4 ranks on 2 hosts joined by a slow link: the pipeline runs across the hosts with tp inside each (the stage
    ILP's sub-mesh), and explain shows the node's alternatives on its stage's tp axis."""
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    cluster = str(_slow_link_cluster(tmp_path / "c.yaml", [[0, 1], [2, 3]]))
    assert main(["explain", "blocks.1.fc.weight", str(tmp_path / "wide.py") + ":wide", "--cluster", cluster,
                 "--consider-pp", "--batch-size", "128"]) == 0
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert "automatic plan: pipeline on mesh pp=2,tp=2" in out and "the pipeline is chosen" in out
    tried = [ln for ln in raw.splitlines() if ln.startswith("│ dp=")]  # the SPMD shapes: none is "chosen"
    assert len(tried) == 2 and sum("best without stages" in ln for ln in tried) == 1
    assert not any("chosen" in ln for ln in tried)
    assert "held by stage 0: layers blocks.0 .. blocks.1 (2), ranks [0, 1], sub-mesh tp=2" in out
    assert "the stage's intra-stage ILP decision (layers blocks.0 .. blocks.1 (2) on tp=2" in out
    assert "on stage 0's mesh axis tp (2 ranks)" in out and "chosen" in out and "why:" in out
