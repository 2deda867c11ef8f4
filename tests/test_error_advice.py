"""Error advice fits where it is given: the command's flags from `adaptdist ...`, the backend's arguments from
`adaptdist.backend(...)` (LoweringOptions.front_end); the backend's lowering arguments (bucket_mb,
replicate_fallback) are checked where written; `--plan auto` honours --replicate-fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptdist
from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.errors import UnsupportedOpError, UsageError
from adaptdist.lowering_options import LoweringOptions, advice_fitting
from models import pairwise_distances


def _pairwise_step():
    return capture(*pairwise_distances())


@pytest.mark.parametrize("front_end", ["cli", "backend"])
def test_no_sharding_rule_advises_the_fallback_of_the_entry_point(front_end):
    cg = _pairwise_step()
    plan = resolve_plan(ManualPlan.parse("dp"), cg, 2)
    with pytest.raises(UnsupportedOpError, match="no sharding rule") as e:
        lower(cg, plan, LoweringOptions(front_end=front_end))
    text = str(e.value)
    if front_end == "cli":
        assert "--replicate-fallback" in text
    else:
        assert "adaptdist.backend(..., replicate_fallback=True)" in text and "--" not in text
    programs = lower(cg, plan, LoweringOptions(front_end=front_end, replicate_fallback=True))  # the advice works
    assert len(programs) == 2


@pytest.mark.parametrize("front_end", ["cli", "backend"])
def test_mesh_advice_names_the_mesh_argument_of_the_entry_point(front_end):
    import adaptdist.models.gpt as gpt_module
    from models import tiny_gpt

    model, batch, loss = tiny_gpt(4, 8)
    cg = capture(model, batch, loss)
    with pytest.raises(UsageError) as e, advice_fitting(front_end):
        resolve_plan(ManualPlan.parse("dp,tp", gpt_module), cg, 4, mesh="dp=4")
    text = str(e.value)
    if front_end == "cli":
        assert text.startswith("--mesh 'dp=4' has axes ['dp']") and "--mesh dp=N,tp=N" in text
    else:
        assert text.startswith("adaptdist.backend(mesh='dp=4') has axes ['dp']") and "--" not in text
        assert "adaptdist.backend(mesh='dp=N,tp=N')" in text


def test_the_backend_rewrites_the_advice_of_every_error_it_raises(monkeypatch):
    import adaptdist.compiler.dynamo_backend as db

    def fails(gm, example_inputs, config):
        raise UsageError("rank 1 reads the inputs of ranks [0, 1]; list the batch axis first in --mesh / the plan file; "
                         "internal: run with -v for the traceback; --plan dp may avoid it")

    monkeypatch.setattr(db, "compile_graph", fails)
    with pytest.raises(UsageError) as e:
        adaptdist.backend(plan="dp")(None, [])
    text = str(e.value)
    assert "adaptdist.backend(mesh=...)" in text and "adaptdist.backend(plan='dp')" in text and "-v" not in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_mb=0), r"bucket_mb=0\) takes a number of MiB > 0"),
    (dict(bucket_mb="big"), r"bucket_mb='big'\)"),
    (dict(replicate_fallback="yes"), r"replicate_fallback='yes'\) takes True or False"),
])
def test_bad_lowering_arguments_of_the_backend_fail_where_written(kwargs, match):
    with pytest.raises(UsageError, match=match):
        adaptdist.backend(**kwargs)


def test_backend_lowering_options_are_the_commands_defaults_unless_given():
    assert adaptdist.backend().lowering_options() == LoweringOptions(front_end="backend")
    assert LoweringOptions().comm == "auto" and adaptdist.backend().comm == "auto"
    opts = adaptdist.backend(bucket_mb=0.5, replicate_fallback=True).lowering_options()
    assert opts.grad_bucket_bytes == 2**19 and opts.replicate_fallback and opts.front_end == "backend"


@pytest.mark.parametrize("kwargs", [dict(grad_bucket_bytes=0), dict(gather_bucket_bytes=1.5), dict(front_end="web"),
                                    dict(disabled_passes=["relax_views"]), dict(replicate_fallback=1)])
def test_lowering_options_are_checked(kwargs):
    with pytest.raises(UsageError, match="LoweringOptions"):
        LoweringOptions(**kwargs)


def test_plan_auto_honours_replicate_fallback(monkeypatch):
    """An op with no strategy at all stops the planner, unless --replicate-fallback: then it is planned
    replicated (its inputs gathered) and the plan lowers."""
    import adaptdist.compiler.planner.problem as problem
    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.planner import plan_auto

    real = problem.node_strategies
    monkeypatch.setattr(problem, "node_strategies", lambda fx, ctx: [] if fx.target is torch.ops.aten._cdist_forward.default
                        else real(fx, ctx))
    cg = _pairwise_step()
    with pytest.raises(UnsupportedOpError, match="cdist"):
        plan_auto(cg, local_cluster(2))
    plan = plan_auto(cg, local_cluster(2), replicate_fallback=True).plan
    assert lower(cg, plan, LoweringOptions(replicate_fallback=True))


def test_the_backend_is_quoted_by_the_options_the_user_set():
    """Dynamo quotes the backend in every compile error: only what the user set, a manual plan by its name."""
    import adaptdist
    from adaptdist.annotations import ManualPlan
    from adaptdist.models import gpt

    assert repr(adaptdist.backend()) == "AdaptdistBackend()"
    assert repr(adaptdist.backend(plan="fsdp", optimizer="sgd")) == "AdaptdistBackend(plan='fsdp', optimizer='sgd')"
    assert repr(adaptdist.backend(plan=ManualPlan.parse("tp", gpt))) == "AdaptdistBackend(plan='tp')"

def test_plan_file_advice_is_rewritten_whole_for_the_backend():
    """``--plan FILE.yaml`` (the ep advice for a model file without EP_PLAN) becomes plan='FILE.yaml', not
    ``plan='FILE').yaml`` (issue 14, found with Hugging Face's Mixtral block under plan='ep')."""
    from adaptdist.lowering_options import advice_for

    text = advice_for("defines none: add one, or pass --plan FILE.yaml with a mesh axis ep", "backend")
    assert text.endswith("pass adaptdist.backend(plan='FILE.yaml') with a mesh axis ep"), text
    assert advice_for("or --plan dp,tp", "backend") == "or adaptdist.backend(plan='dp,tp')"
    assert advice_for("train with --plan fsdp.", "backend") == "train with adaptdist.backend(plan='fsdp')."


def _distances(h):
    return torch.cdist(h, h)  # no sharding rule


class _DistancesInAHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _distances(self.lin(x))


@pytest.mark.parametrize("where", ["model", "loss"])
def test_no_sharding_rule_names_the_users_module_and_line(where):
    """The refusal names the op's module and the line of the user's code that ran it, here in a free function
    the forward (or the loss function) calls (before: only the node; the captured graph has no nn_module_stack)."""
    import inspect

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    if where == "model":
        cg = capture(nn.Sequential(_DistancesInAHelper()), (x, torch.randn(6, 6)), F.mse_loss)
    else:
        cg = capture(nn.Linear(4, 4), (x, torch.randn(6, 6)), lambda out, y: F.mse_loss(_distances(out), y))
    lines, first = inspect.getsourcelines(_distances)
    line = first + next(i for i, t in enumerate(lines) if "# no sharding rule" in t)
    with pytest.raises(UnsupportedOpError, match="no sharding rule") as e:
        lower(cg, resolve_plan(ManualPlan.parse("dp"), cg, 2), LoweringOptions())
    where_part = "in module `0` (_DistancesInAHelper)" if where == "model" else "in the loss function"
    assert f"at node '_cdist_forward' {where_part} (test_error_advice.py:{line}: `return torch.cdist(h, h)" \
        in str(e.value), str(e.value)
