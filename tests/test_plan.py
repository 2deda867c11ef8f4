import pytest

from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import PlanMismatchError, UsageError
from adaptdist.annotations import ManualPlan
from adaptdist.placement import Shard
from adaptdist.plan import Plan, graph_fingerprint
from adaptdist.program import load_program, save_programs
from models import mlp


def test_plan_round_trips_through_json_and_the_program_directory(tmp_path):
    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))
    plan = progs[0].plan
    assert plan.mesh == {"dp": 2} and plan.batch_axis == "dp"
    assert plan.param_placements["fc1.weight"] == (Shard(0),)  # typed in memory, text only in plan.json
    assert plan.node_placements == {} and plan.lowered is not None  # the decision apart from the lowering's record
    assert any(isinstance(v[0], Shard) for v in plan.lowered.node_placements.values())
    assert Plan.from_json(plan.to_json()) == plan
    save_programs(progs, tmp_path)
    assert load_program(tmp_path, 1).plan == plan
    # a saved plan trains the same model again, and gives the same programs
    again = compile_model(model, batch, loss_fn, 2, ManualPlan.parse(str(tmp_path / "plan.json")))
    assert again[1].code == progs[1].code


def test_plan_for_another_graph_is_refused(tmp_path):
    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))
    (tmp_path / "plan.json").write_text(progs[0].plan.to_json())
    other_model, other_batch, _ = mlp(9)  # another batch size: another graph
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        compile_model(other_model, other_batch, loss_fn, 2, ManualPlan.parse(str(tmp_path / "plan.json")))
    with pytest.raises(UsageError, match="dp=2 .2 ranks., this job has 3"):
        compile_model(model, batch, loss_fn, 3, ManualPlan.parse(str(tmp_path / "plan.json")))


def test_fingerprint_depends_on_structure_not_values():
    m1, b1, l1 = mlp(7, seed=0)
    m2, b2, l2 = mlp(7, seed=1)
    assert graph_fingerprint(capture(m1, b1, l1).gm) == graph_fingerprint(capture(m2, b2, l2).gm)


def test_bad_plan_json_names_the_field(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"schema_version": 1, "mesh": {"dp": 2}}')
    with pytest.raises(UsageError, match="batch_axis"):
        Plan.load(f)


def test_a_departure_from_the_planners_strategies_is_one_line_recorded_in_the_plan(monkeypatch, caplog, tmp_path):
    """Where the lowering cannot follow the planner's node strategies it lowers the plan's parameter placements
    with the rules' activations: one warning line naming the node and the reason (no trace), and plan.json's
    lowering record lists it apart from the decision."""
    import logging

    import adaptdist.compiler.lowering as lowering
    from adaptdist.errors import UnsupportedOpError
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.strategy import Strategy

    model, batch, loss_fn = mlp(8)
    cg = capture(model, batch, loss_fn)
    plan = Plan(mesh={"dp": 2}, batch_axis="dp", param_placements={}, graph_fingerprint=graph_fingerprint(cg.gm),
                name="auto", node_strategies={"addmm": (Strategy.parse("S(0),R,R->S(0)"),)})
    real = lowering._lower_mesh

    def failing(captured, p, options, *, follow_strategies, **kw):
        if follow_strategies:
            e = UnsupportedOpError("op aten.mm.default at node 'mm_2' (f32[8, 16]) cannot take S(1) here\n"
                                   "While executing %mm_2 : [num_users=1] = call_function[target=aten.mm](...)")
            e.axis = "dp"
            raise e
        return real(captured, p, options, follow_strategies=follow_strategies, **kw)

    monkeypatch.setattr(lowering, "_lower_mesh", failing)
    with caplog.at_level(logging.WARNING, logger="adaptdist.compiler"):
        progs = lowering.lower(cg, plan, LoweringOptions())
    lines = [r.getMessage() for r in caplog.records if "departs" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "While executing" not in lines[0]
    assert "node 'mm_2' on mesh axis 'dp': op aten.mm.default at node 'mm_2'" in lines[0]
    record = progs[0].plan.lowered
    assert [(d.node, d.axis) for d in record.departures] == [("mm_2", "dp")]
    again = Plan.from_json(progs[0].plan.to_json())
    assert again.lowered.departures == record.departures and again.node_strategies == plan.node_strategies


@pytest.mark.parametrize("field,value,match", [
    ("param_placements", {"fc1.weight": ["S(x)"]}, r"field param_placements\['fc1.weight'\]: not a placement"),
    ("param_placements", {"fc1.weight": ["S(0)", "R"]}, r"field param_placements\['fc1.weight'\] must be 1 placement"),
    ("node_strategies", {"mm": ["S(0)"]}, r"field node_strategies\['mm'\]: strategy 'S\(0\)' is not INPUTS->OUTPUTS"),
    ("mesh", [["dp", "two"]], "field 'mesh' must be"),
    ("batch_axis", "tp", "field 'batch_axis' is 'tp', not a mesh axis"),
    ("lowered", {"redistributions": {"dp": [["a", "b", "S(0)"]]}}, r"field lowered.redistributions\['dp'\] holds"),
])
def test_every_field_is_type_checked_on_load(field, value, match):
    doc = {"schema_version": 2, "name": "p", "mesh": [["dp", 2]], "batch_axis": "dp", "graph_fingerprint": "x",
           "param_placements": {}}
    doc[field] = value
    import json

    with pytest.raises(UsageError, match="plan 'f.json': " + match):
        Plan.from_json(json.dumps(doc), "f.json")
