"""adaptdist/compiler/expert_lists.py: experts written as an nn.ModuleList of MLPs are captured as one stacked
``[E, ...]`` parameter per expert parameter, so ``--plan ep`` / an ``ep`` axis / the planner put different experts
on different ranks (tokens by all_to_all), with the user's names kept for the weights.

Numerics: every rank's program simulated in one process for SGD steps against single-process eager: loss, every
rank's shard of every gradient (a stacked gradient is the user's E gradients stacked) and of the parameters after
the steps, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.expert_lists import fold_stack_of_unbind
from adaptdist.state_layout import unstack_state
from adaptdist.compiler.lowering import compile_model
from adaptdist.mesh import lowering_order
from adaptdist.models import moe
from adaptdist.placement import Shard
from adaptdist.runtime.simulate import simulate_ranks
from moe_workers import gathered_params, starve_last_expert
from passutil import global_shard
from reference import eager_sgd

LR, TOL = 0.5, 1e-5
EP = ManualPlan.parse("ep", moe)  # moe.py's EP_PLAN names the stacked form's weights: dropped for a list


def _stacked(named: dict[str, torch.Tensor], stacked: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    return {**named, **{s: torch.stack([named[m] for m in ms]) for s, ms in stacked.items()}}


def run_sgd(model, batch, loss_fn, plan, world: int, steps: int = 2):
    """Compile for ``world`` simulated ranks, run ``steps`` SGD steps checking loss, gradient and parameter
    shards against eager (user names stacked as the capture stacks them); returns the programs."""
    progs = compile_model(model, batch, loss_fn, world, plan)
    p0 = progs[0]
    stacked = p0.stacked
    mesh = p0.plan.mesh_spec
    order = lowering_order(mesh, p0.plan.batch_axis)
    history, final = eager_sgd(model, [batch], loss_fn, LR, steps)
    for step, (loss, grads) in enumerate(history):
        grads = _stacked(grads, stacked)
        ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
        outs = simulate_ranks([p.module for p in progs.values()], ins, mesh)
        for r, p in progs.items():
            assert float(outs[r][p.loss_index]) == pytest.approx(loss, abs=TOL), (r, step)
            for f in p.param_fqns:
                g = outs[r][p.output_roles.index(f"grad:{f}")]
                want = global_shard(grads[f], p.state_placements.get(f), mesh, r, order)
                torch.testing.assert_close(g, want, atol=TOL, rtol=TOL, msg=f"rank {r} step {step} grad {f}")
                p.state[f] = p.state[f] - LR * g
    final = _stacked(final, stacked)
    for r, p in progs.items():
        for f in p.param_fqns:
            want = global_shard(final[f], p.state_placements.get(f), mesh, r, order)
            torch.testing.assert_close(p.state[f], want, atol=TOL, rtol=TOL, msg=f"rank {r} param {f}")
    return progs, history


def _kinds(prog) -> list[str]:
    return [str(n.target).split(".")[1] for n in prog.module.graph.nodes
            if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]


def test_capture_stacks_the_list_and_folds_the_users_stack():
    model, batch, loss_fn = moe.list_factory(4)
    c = capture(model, batch, loss_fn)
    assert c.stacked["moe.experts.*.fc.weight"] == [f"moe.experts.{i}.fc.weight" for i in range(4)]
    ph = {n.meta.get("fqn", n.name): n for n in c.gm.graph.find_nodes(op="placeholder")}
    assert "moe.experts.0.fc.weight" not in c.param_fqns and "moe.experts.*.out.bias" in c.param_fqns
    assert tuple(c.gm.graph.find_nodes(op="placeholder")[c.input_fqns.index("moe.experts.*.fc.weight")]
                 .meta["val"].shape) == (4, 32, 16), ph.keys()
    aten = torch.ops.aten
    targets = [n.target for n in c.gm.graph.nodes]
    assert aten.bmm.default in targets and aten.stack.default not in targets and aten.unbind.int not in targets
    assert fold_stack_of_unbind(c.gm) is False  # nothing left to fold


@pytest.mark.parametrize("world,n_experts", [(2, 4), (4, 4), (2, 3)])
def test_ep_holds_each_ranks_experts_only_and_equals_eager(world, n_experts):
    """4 experts on 2 and 4 ranks, 3 on 2 (2 + 1, torch.chunk's split): each rank stores and multiplies its
    experts only, tokens move by all_to_all, nothing is all_gathered; SGD steps equal eager's."""
    model, batch, loss_fn = moe.list_factory(4, n_experts=n_experts)
    progs, _ = run_sgd(model, batch, loss_fn, EP, world)
    want = [len(c) for c in torch.arange(n_experts).chunk(world)] + [0] * world
    for r, p in progs.items():
        local = want[r]
        assert p.state_placements["moe.experts.*.fc.weight"] == ["S(0)"]
        for f in p.stacked:
            assert p.state[f].shape[0] == local, (r, f, tuple(p.state[f].shape))
        assert not any(f.startswith("moe.experts.") and f not in p.stacked for f in p.state), sorted(p.state)
        kinds = _kinds(p)
        assert "all_to_all_single" in kinds and gathered_params(p) == [] and not any("gather" in k for k in kinds)
        bmm = [n for n in p.module.graph.nodes if n.target == torch.ops.aten.bmm.default]
        assert bmm and all(n.meta["val"].shape[0] == local for n in bmm), [n.meta["val"].shape for n in bmm]


def test_an_expert_without_tokens_gets_exactly_zero_gradient():
    """3 experts, top-1, expert 2 never picked: its gradients are exactly zero in eager and on the rank that
    holds it; the masked slots of the others give none either (the program equals eager's gradients)."""
    model, batch, loss_fn = moe.list_factory(4, n_experts=3, k=1)
    starve_last_expert(model)
    progs, history = run_sgd(model, batch, loss_fn, EP, 2, steps=1)
    (_, grads), = history
    assert grads["moe.experts.2.fc.weight"].abs().max() == 0 < grads["moe.experts.0.fc.weight"].abs().max()
    p1 = progs[1]
    ins = [[p.state[f] for f in p.input_fqns] + list(p.local_batch(batch)) for p in progs.values()]
    # the state was updated by the run; a zero gradient left the expert as it was: its row equals the model's
    assert torch.equal(p1.state["moe.experts.*.fc.weight"][0], model.moe.experts[2].fc.weight.detach())
    assert ins  # the programs still run from the updated state (checked step by step above)


def test_planner_chooses_expert_parallelism_for_a_list():
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster

    model, batch, loss_fn = moe.list_factory(4, 8, d=64, hidden=256)
    result = plan_auto(capture(model, batch, loss_fn), FixedCluster.uniform([("h", 2)]))
    pp = result.plan.param_placements
    assert pp.get("moe.experts.*.fc.weight") == pp.get("moe.experts.*.out.weight") == (Shard(0),), pp
    progs, _ = run_sgd(model, batch, loss_fn, result.plan, 2, steps=1)
    assert tuple(progs[0].state["moe.experts.*.fc.weight"].shape) == (2, 256, 64)


def test_list_under_fsdp_still_equals_eager():
    """The stacked list under fsdp (dp: tests/test_moe.py's list forms): sharded on dim 0 as any parameter."""
    model, batch, loss_fn = moe.list_factory(4)
    run_sgd(model, batch, loss_fn, ManualPlan.parse("fsdp"), 2, steps=1)


class _LoopMoE(nn.Module):
    """Experts as users often combine them: a Python loop adding each expert's output weighted by its column of the
    router's dense top-k gates (zero where the router did not pick it)."""

    def __init__(self, d: int = 16, hidden: int = 32, n_experts: int = 4, k: int = 2):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(moe.ExpertMLP(d, hidden) for _ in range(n_experts))
        self.k = k

    def forward(self, x):
        w, idx = torch.topk(F.softmax(self.gate(x), -1), self.k, -1)
        g = torch.zeros(x.shape[0], len(self.experts)).scatter_add(1, idx, w)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + g[:, e:e + 1] * expert(x)
        return out


def test_a_loop_combine_is_recognised_too():
    """The loop's experts read the same tokens: held stacked and split under ep, equal to eager; each expert's
    rows of the output are all_gathered for the loop's sums (an activation), never an expert weight."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    progs, _ = run_sgd(_LoopMoE(), (x, y), F.mse_loss, EP, 2)
    for p in progs.values():
        assert tuple(p.state["experts.*.fc.weight"].shape) == (2, 32, 16) and gathered_params(p) == []


class _Chained(nn.Module):
    """A ModuleList of identical blocks applied one after another (a transformer's layers): not experts."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class _OwnSlices(nn.Module):
    """Experts each on their own slice of the tokens (a fixed capacity split): not batched, noted."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return torch.cat([e(c) for e, c in zip(self.experts, x.chunk(2, dim=0))])


def test_lists_that_are_not_dense_experts_are_left_as_they_are():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    c = capture(_Chained(), (x, y), F.mse_loss)
    assert not c.stacked and not c.notes and "blocks.0.weight" in c.param_fqns
    c = capture(_OwnSlices(), (x, y), F.mse_loss)
    assert not c.stacked and "experts.1.weight" in c.param_fqns
    assert len(c.notes) == 1 and "experts (2 identical modules)" in c.notes[0] and "different inputs" in c.notes[0]
    progs, _ = run_sgd(_OwnSlices(), (x, y), F.mse_loss, ManualPlan.parse("dp"), 2, steps=1)


def test_unstack_state_gives_the_users_names():
    state = {"a": torch.zeros(2), "e.*.w": torch.arange(6.).reshape(3, 2)}
    out = unstack_state(state, {"e.*.w": ["e.0.w", "e.1.w", "e.2.w"]})
    assert list(out) == ["a", "e.0.w", "e.1.w", "e.2.w"] and torch.equal(out["e.2.w"], torch.tensor([4., 5.]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaptdist_train_ep_on_a_list_equals_eager_and_resumes_on_one_rank(tmp_path):
    """``adaptdist train adaptdist/models/moe.py:list_factory --plan ep`` on 2 gloo ranks for 2 SGD steps, then
    resumed on 1 rank for a third: the losses equal eager's, the 2-rank programs move tokens by all_to_all and
    gather nothing, the checkpoint holds each expert under the user's name (``moe.experts.3.fc.weight``: each rank
    saved its own experts, the resumed rank read them all), and model.safetensors holds the trained weights under
    those names, equal to eager's."""
    import json
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from adaptdist.cli import main

    out = tmp_path / "run"
    assert main(["train", f"{Path(moe.__file__)}:list_factory", "--plan", "ep", "--nproc", "2", "--steps", "2",
                 "--batch-size", "4", "--seq-len", "6", "--optimizer", "sgd", "--lr", str(LR), "--threads-per-rank",
                 "1", "--sample-bytes", "0", "--timeout-s", "60", "--checkpoint-every", "1", "--out", str(out)]) == 0
    code = (out / "programs" / "rank0" / "program.py").read_text()
    assert "mesh ep=2" in code and "all_to_all" in code and "all_gather" not in code
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    keys = set(dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)
    assert "model.moe.experts.3.fc.weight" in keys and not any("*" in k for k in keys), sorted(keys)
    assert main(["train", "--resume", str(out), "--steps", "3", "--nproc", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    model, batch, loss_fn = moe.list_factory(4, 6)
    history, final = eager_sgd(model, [batch], loss_fn, LR, 3)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor([h[0] for h in history]), atol=TOL,
                               rtol=0)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(final), sorted(set(weights) ^ set(final))
    for n, v in final.items():
        torch.testing.assert_close(weights[n], v, atol=TOL, rtol=TOL, msg=n)


def test_plan_and_explain_lines_name_the_stacked_experts_and_the_notes():
    from adaptdist.compiler.expert_lists import expert_lines

    stacked = {"moe.experts.*.fc.weight": ["moe.experts.0.fc.weight", "moe.experts.1.fc.weight"],
               "moe.experts.*.fc.bias": ["moe.experts.0.fc.bias", "moe.experts.1.fc.bias"]}
    lines = expert_lines(stacked, ["experts (2 identical modules) is not sharded as experts: why"])
    assert lines[0].startswith("experts moe.experts: 2 ModuleList experts held stacked") and "fc.bias" in lines[0]
    assert lines[1] == "note: experts (2 identical modules) is not sharded as experts: why" and len(lines) == 2


class _DropoutExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


class _Experts(nn.Module):
    """Dense experts (``expert``: the module class), their outputs summed; ``aux``: an extra loss term reading
    expert 0's weight directly (outside its forward)."""

    def __init__(self, expert=None, aux: bool = False):
        super().__init__()
        self.experts = nn.ModuleList((expert or (lambda: nn.Linear(8, 8)))() for _ in range(3))
        self.aux = aux

    def forward(self, x):
        out = torch.stack([e(x) for e in self.experts]).sum(0)
        return out + (self.experts[0].weight.sum() if self.aux else 0)


def test_a_list_that_cannot_run_batched_is_captured_as_it_is_with_a_note():
    """Dropout inside each expert: vmap refuses random ops by default, so the batched capture fails; the list is
    then captured as it was (unsharded, a note saying why) instead of failing."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    c = capture(_Experts(_DropoutExpert), (x, y), F.mse_loss)
    assert not c.stacked and "experts.0.fc.weight" in c.param_fqns
    assert len(c.notes) == 1 and "running them batched failed" in c.notes[0], c.notes


def test_an_expert_weight_read_outside_its_forward_gets_that_gradient_too():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    progs, _ = run_sgd(_Experts(aux=True), (x, y), F.mse_loss, EP, 2, steps=1)
    assert "experts.*.weight" in progs[0].stacked


def test_pipeline_programs_keep_the_experts_names_through_their_files(tmp_path):
    """Under ``--plan pp`` the list is held stacked by its stage; program.json records the user's names (what
    model.safetensors is written under), and a malformed record is refused on load."""
    import json

    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from adaptdist.errors import ProgramLoadError
    from adaptdist.stage_program_io import load_pipeline_program, save_pipeline_programs

    model, batch, loss_fn = moe.list_factory(4)
    progs = compile_model(model, batch, loss_fn, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    assert progs[1].stacked["moe.experts.*.out.bias"] == tuple(f"moe.experts.{i}.out.bias" for i in range(4))
    save_pipeline_programs(progs, tmp_path)
    assert load_pipeline_program(tmp_path, 1, 2).stacked == progs[1].stacked
    meta_path = tmp_path / "rank1" / "program.json"
    meta = json.loads(meta_path.read_text())
    meta["stacked"] = {"moe.experts.*.out.bias": "not a list"}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ProgramLoadError):  # the manifest's checksum, or the field's check
        load_pipeline_program(tmp_path, 1, 2)
