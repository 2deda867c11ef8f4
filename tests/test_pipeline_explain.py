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
