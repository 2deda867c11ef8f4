"""The pass pipeline as data (passes/pipeline.py) and its runner (passes/infra.py): README table, disabling,
dumps with op-count diffs, the lint/DCE/recompile tail, debug invariant checks, internal-error advice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import InternalError, UsageError
from adaptdist.lowering_options import LoweringOptions
from adaptdist.passes.context import PassContext
from adaptdist.passes.infra import copy_graph_module, pass_names, run_pipeline
from adaptdist.passes.pipeline import PASSES
from models import mlp

README = Path(__file__).parent.parent / "adaptdist" / "passes" / "README.md"


def test_readme_pass_table_is_the_pipeline():
    rows = [m.group(1) for m in re.finditer(r"^\| `(\w+)`[^|]*\|", README.read_text(), re.M)]
    per_axis = [r for r in rows if r != "localize_shapes"]  # localization runs per rank after the pipeline
    assert per_axis == pass_names(PASSES)
    assert rows[-1] == "localize_shapes"


def test_unknown_disabled_pass_lists_the_passes():
    model, batch, loss = mlp(8)
    with pytest.raises(UsageError, match="'no_such_pass', not a pass of the pipeline; the passes are decompose_addmm, "
                                         "sync_batch_norm, decompose_embedding_bag, propagate_placements"):
        compile_model(model, batch, loss, 2, None, LoweringOptions(disabled_passes=("no_such_pass",)))


def test_dumps_before_and_after_with_op_counts_and_disabled_passes_do_not_run(tmp_path):
    model, batch, loss = mlp(8)
    compile_model(model, batch, loss, 2, ManualPlan.parse("dp"),
                  LoweringOptions(dump_dir=str(tmp_path), disabled_passes=("relax_views",)))
    d = tmp_path / "dp"
    k = pass_names(PASSES).index("bucket_grad_allreduce")
    assert (d / f"{k:02d}_bucket_grad_allreduce.before.txt").is_file()
    assert (d / f"{k:02d}_bucket_grad_allreduce.after.txt").is_file()
    ops = (d / f"{k:02d}_bucket_grad_allreduce.ops.txt").read_text()
    assert re.search(r"^\+\d+ _c10d_functional.all_reduce.default$", ops, re.M), ops
    assert not list(d.glob("*relax_views*"))  # disabled: not run, not dumped


def _graph():
    model, batch, loss = mlp(8)
    cg = capture(model, batch, loss)
    return copy_graph_module(cg.gm), PassContext(axis_size=2, batch_size=cg.batch_size)


def test_the_runner_does_the_tail_once_after_a_pass_that_changed_the_graph():
    gm, ctx = _graph()
    first = next(n for n in gm.graph.nodes if n.op == "call_function")

    def add_dead_node(gm, ctx):
        with gm.graph.inserting_after(first):
            dead = gm.graph.call_function(torch.ops.aten.neg.default, (first,))
        dead.meta["val"] = first.meta["val"]
        return gm, True

    out = run_pipeline(gm, ctx, (add_dead_node,), LoweringOptions(debug=True))
    assert not any(n.target is torch.ops.aten.neg.default for n in out.graph.nodes)  # dead code eliminated
    assert "neg" not in out.code  # and the code regenerated


def test_debug_mode_checks_the_invariants_after_each_pass():
    gm, ctx = _graph()

    def lies(gm, ctx):  # changes the graph but says it did not (invariant 4)
        n = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.t.default)
        with gm.graph.inserting_after(n):
            extra = gm.graph.call_function(torch.ops.aten.neg.default, (n,))
        extra.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
        return gm, False

    run_pipeline(copy_graph_module(gm), ctx, (lies,), LoweringOptions())  # not checked outside debug mode
    with pytest.raises(InternalError, match=r"pass lies broke an invariant of passes/README.md: it returned "
                                            r"changed=False but changed the graph \(4\)"):
        run_pipeline(gm, ctx, (lies,), LoweringOptions(debug=True))


def test_debug_mode_holds_on_a_real_lowering():
    import adaptdist.models.gpt as gpt_module
    from models import tiny_gpt

    model, batch, loss = tiny_gpt(4, 8)
    progs = compile_model(model, batch, loss, 4, ManualPlan.parse("dp,tp", gpt_module), LoweringOptions(debug=True),
                          mesh="dp=2,tp=2")
    assert len(progs) == 4


def _boom(gm, ctx):
    raise KeyError("x")


@pytest.mark.parametrize("front_end,plan,trace,other", [
    ("cli", "fsdp", "run with -v for the traceback", "--plan dp may avoid it"),
    ("cli", "dp", "run with -v for the traceback", None),
    ("backend", "fsdp", "logging.getLogger('adaptdist').setLevel(logging.DEBUG)", "adaptdist.backend(plan='dp') may"),
    ("backend", "dp", "logging.getLogger('adaptdist').setLevel(logging.DEBUG)", None),
])
def test_internal_error_advice_fits_the_entry_point_and_the_plan(front_end, plan, trace, other):
    gm, ctx = _graph()
    with pytest.raises(InternalError) as e:
        run_pipeline(gm, ctx, (_boom,), LoweringOptions(front_end=front_end), plan_name=plan)
    text = str(e.value)
    assert "internal error in pass _boom: KeyError" in text and trace in text
    assert ("-v" not in text) if front_end == "backend" else ("logging" not in text)
    if other:
        assert other in text
    else:
        assert "may avoid it" not in text  # the plan already is dp


def test_the_commands_set_the_pipeline_options():
    from adaptdist.cli.main import build_parser, lowering_options

    args = build_parser().parse_args(["compile", "-o", "x", "--bucket-mb", "0.5", "--debug-passes",
                                      "--disable-pass", "relax_views", "--replicate-fallback"])
    assert lowering_options(args) == LoweringOptions(grad_bucket_bytes=2**19, debug=True,
                                                     disabled_passes=("relax_views",), replicate_fallback=True)
    assert lowering_options(build_parser().parse_args(["plan"])) == LoweringOptions()  # one default everywhere


def test_debug_invariants_accept_the_exporters_assert_nodes():
    """``_assert_tensor_metadata`` (which the exporter leaves in graphs that cast: HF BERT's mask) returns nothing:
    the invariant checks of --debug-passes must not call its missing meta['val'] a broken pass."""
    import torch.fx

    from adaptdist.passes.infra import _returns_nothing

    g = torch.fx.Graph()
    x = g.placeholder("x")
    check = g.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    y = g.call_function(torch.ops.aten.neg.default, (x,))
    assert _returns_nothing(check) and not _returns_nothing(y)


def test_a_pass_the_numbers_rely_on_cannot_be_skipped():
    """Skipping the pass that all-reduces a sharded max would give each rank its own max silently: refused."""
    import pytest
    from adaptdist.errors import UsageError
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.passes.pipeline import SKIPPABLE, check_skippable

    with pytest.raises(UsageError, match="all_reduce_extrema.*rely on it"):
        check_skippable(LoweringOptions(disabled_passes=("all_reduce_extrema",)))
    with pytest.raises(UsageError, match="no_such_pass"):
        check_skippable(LoweringOptions(disabled_passes=("no_such_pass",)))
    check_skippable(LoweringOptions(disabled_passes=tuple(sorted(SKIPPABLE))))
