import pytest

from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import PlanMismatchError, UsageError
from adaptdist.annotations import ManualPlan
from adaptdist.plan import Plan, graph_fingerprint
from adaptdist.program import load_program, save_programs
from models import mlp


def test_plan_round_trips_through_json_and_the_program_directory(tmp_path):
    model, batch, loss_fn = mlp(7)
    progs = compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))
    plan = progs[0].plan
    assert plan.mesh == {"dp": 2} and plan.batch_axis == "dp"
    assert plan.param_placements["fc1.weight"] == ["S(0)"]
    assert any(v[0].startswith("S(") for v in plan.node_placements.values())
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
