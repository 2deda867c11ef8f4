"""adaptdist/compiler/dynamo_expert_lists.py: the torch.compile backend's Dynamo graph of ModuleList experts is
rewritten to one batched call on stacked ``[E, ...]`` inputs, so ``plan="ep"`` and the planner keep each rank to
its experts. Numerics on real gloo ranks: tests/test_moe.py::test_backend_on_two_gloo_ranks_equals_eager (list
cases)."""

from __future__ import annotations

import pytest
import torch

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs
from adaptdist.compiler.dynamo_expert_lists import stack_dynamo_experts
from adaptdist.compiler.expert_lists import fold_stack_of_unbind
from adaptdist.compiler.lowering import lower, resolve_plan
from adaptdist.lowering_options import LoweringOptions
from adaptdist.models import moe
from moe_workers import gathered_params


def _dynamo(model, x):
    """(Dynamo graph, its inputs) of ``model(x)``."""
    seen = {}

    def keep(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, classify_inputs(gm, example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep, dynamic=False)(x)
    torch._dynamo.reset()
    return seen["gm"], seen["inputs"]


def test_rewrite_runs_the_same_values_with_stacked_inputs():
    model, (x, _), _ = moe.list_factory(4)
    gm, inputs = _dynamo(model, x)
    new, new_inputs, found = stack_dynamo_experts(gm, inputs)
    assert found.stacked["moe.experts.*.out.weight"] == [f"moe.experts.{i}.out.weight" for i in range(4)]
    assert [i.fqn for i in new_inputs if "experts" in i.fqn] == list(found.stacked)
    named = dict(model.named_parameters())
    args = []
    for gi in new_inputs:
        if gi.kind == "input":
            args.append(x)
        elif gi.fqn in found.stacked:
            args.append(torch.stack([named[m] for m in found.stacked[gi.fqn]]))
        else:
            args.append(named[gi.fqn])
    torch.testing.assert_close(new(*args)[0], model(x), atol=1e-6, rtol=1e-6)
    assert not any("experts.0" in str(n.meta.get("nn_module_stack", "")) for n in new.graph.nodes)


@pytest.mark.parametrize("world,n_experts", [(2, 4), (2, 3)])
def test_ep_keeps_each_ranks_experts(world, n_experts):
    """The rank programs of ``plan="ep"`` on a list hold E/world experts each (3 on 2: 2 + 1), move tokens by
    all_to_all and all_gather no parameter."""
    model, (x, _), _ = moe.list_factory(4, n_experts=n_experts)
    gm, inputs = _dynamo(model, x[:4 // world])
    gm, inputs, found = stack_dynamo_experts(gm, inputs)
    captured, _ = capture_all_ranks(gm, inputs, world)
    captured.stacked = found.stacked
    fold_stack_of_unbind(captured.gm)
    progs = lower(captured, resolve_plan(ManualPlan.parse("ep", moe), captured, world),
                  LoweringOptions.from_mb(None, front_end="backend"))
    local = [len(c) for c in torch.arange(n_experts).chunk(world)]
    for r, p in progs.items():
        assert p.state_placements["moe.experts.*.fc.weight"] == ["S(0)"]
        assert gathered_params(p) == []
        assert any("all_to_all" in c for c in p.collectives()), p.collectives()
        bmm = [n for n in p.graph_module.graph.nodes if n.target == torch.ops.aten.bmm.default]
        assert bmm and all(n.meta["val"].shape[0] == local[r] for n in bmm)


class _OwnTokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return torch.cat([e(c) for e, c in zip(self.experts, x.chunk(2, dim=1))], dim=1)


def test_experts_on_their_own_tokens_are_left_with_a_note():
    model = _OwnTokens()
    gm, inputs = _dynamo(model, torch.randn(4, 16))
    new, new_inputs, found = stack_dynamo_experts(gm, inputs)
    assert new is gm and new_inputs is inputs and not found.stacked
    assert len(found.notes) == 1 and "experts (2 identical modules)" in found.notes[0] and "different" in found.notes[0]


class _DropoutExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
                                           for _ in range(2))

    def forward(self, x):
        return torch.stack([e(x) for e in self.experts]).sum(0)


def test_experts_that_cannot_run_batched_are_left_with_a_note():
    """Dropout inside each expert: vmap refuses the random op while tracing the batched call; the list is left as
    it is, with a note, instead of failing the compile."""
    model = _DropoutExperts()
    gm, inputs = _dynamo(model, torch.randn(4, 8))
    new, new_inputs, found = stack_dynamo_experts(gm, inputs)
    assert new is gm and not found.stacked
    assert len(found.notes) == 1 and "running them batched failed" in found.notes[0], found.notes
