import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import PlanMismatchError, UsageError
from adaptdist.annotations import ManualPlan
from adaptdist.placement import Shard
from adaptdist.plan import Plan, graph_fingerprint
from adaptdist.program import load_program, save_programs
from models import mlp, tiny_gpt


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


def _gathered_params(program) -> dict[str, bool]:
    """Each trainable parameter of a rank program -> whether an all_gather reads it (through layout ops, pads and
    bucket cats) rather than an op using its local shard."""
    passthrough = ("view", "t.default", "reshape", "constant_pad", "cat", "_to_copy", "clone", "detach", "transpose",
                   "permute", "flatten")
    out = {}
    phs = list(program.module.graph.find_nodes(op="placeholder"))
    for fqn, node in zip(program.input_fqns, phs):
        if fqn not in program.param_fqns:
            continue
        seen, todo, gathered = set(), [node], False
        while todo and not gathered:
            for user in todo.pop().users:
                if user in seen:
                    continue
                seen.add(user)
                gathered |= "all_gather" in str(user.target)
                if any(p in str(user.target) for p in passthrough):
                    todo.append(user)
        out[fqn] = gathered
    return out


class _MultiheadAttentionLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.ln(self.emb(x))
        return self.head(h + self.attn(h, h, h, need_weights=False)[0])


def test_fsdp_fixes_where_parameters_live_and_each_op_how_it_uses_a_shard():
    """README's --plan fsdp: every trainable parameter is stored sharded; the built-in GPT all-gathers every weight
    where it is used but its position table (looked up shard by shard, the rows all-reduced), and so does a model
    with nn.MultiheadAttention(batch_first=True): its merge of [T, B, D] into [T*B, D] rows keeps the batch split
    (compiler/batch_inner_merges.py; once it gathered the activation and a Linear behind it computed on its weight
    shard, tensor-parallel style)."""
    model, batch, loss_fn = tiny_gpt(4)
    prog = compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))[0]
    assert all(isinstance(p[0], Shard) for p in prog.plan.param_placements.values())
    gathered = _gathered_params(prog)
    assert [f for f, g in gathered.items() if not g] == ["pos_emb.weight"], gathered  # looked up shard by shard
    assert sum(gathered.values()) == len(prog.param_fqns) - 1 > 10

    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 6))
    prog = compile_model(_MultiheadAttentionLM(), (x, x.roll(1, 1)),
                         lambda o, y: F.cross_entropy(o.reshape(-1, 32), y.reshape(-1)), 2, ManualPlan.parse("fsdp"))[0]
    assert all(isinstance(p[0], Shard) for p in prog.plan.param_placements.values())
    gathered = _gathered_params(prog)
    assert all(gathered.values()), gathered
