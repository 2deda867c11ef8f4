"""Placements on 2-D meshes, all ranks simulated in one process (collectives on each axis's groups).

Every case compares each rank's loss and its shard of every gradient with single-process
eager. A shard of a dim sharded on several axes is chunked in lowering order (model-parallel
axes first, then the batch axis).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import lowering_order
from adaptdist.mesh import Mesh
from models import MLP, tiny_gpt, tiny_llama
from passutil import global_shard, simulate_mesh
from reference import eager_sgd


def check(model, batch, loss_fn, mesh_text, plan, **kw):
    progs, outs = simulate_mesh(model, batch, loss_fn, mesh_text, plan, **kw)
    (loss, grads), = eager_sgd(model, [batch], loss_fn, 0.1, 1)[0]
    mesh = Mesh.parse(mesh_text)
    order = lowering_order(mesh, progs[0].plan.batch_axis)
    for r, p in progs.items():
        assert abs(float(outs[r][p.loss_index]) - loss) < 1e-5, (r, float(outs[r][p.loss_index]), loss)
        for f in p.param_fqns:
            got = outs[r][p.output_roles.index(f"grad:{f}")]
            want = global_shard(grads[f], p.state_placements.get(f), mesh, r, order)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {r} grad {f}")
    return progs


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "dp=1,tp=2", "dp=2,tp=1", "dp=1,tp=1", "dp=3,tp=2", "dp=4,tp=2"])
def test_gpt_dp_x_tp(mesh):
    """Megatron TP inside each data-parallel replica; batch 5 over dp=3 is 2,2,1, over dp=4 one rank is empty."""
    model, batch, loss_fn = tiny_gpt(5, 8)
    progs = check(model, batch, loss_fn, mesh, "dp,tp")
    m = Mesh.parse(mesh)
    groups = {c.split("(")[1].split(",")[0] for c in progs[0].collectives()}
    assert groups == {f"adaptdist:{a}" for a, n in m.axes if n > 1}


def test_llama_dp_x_tp_on_2x2():
    import adaptdist.models.llama as llama

    model, batch, loss_fn = tiny_llama(5, 8)
    check(model, batch, loss_fn, "dp=2,tp=2", "dp,tp", model_module=llama)


def _mlp_batch(rows=7):
    torch.manual_seed(0)
    model = MLP()  # 12 -> 24 -> 5
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)), F.cross_entropy


def plan(axes, batch_axis, **params):
    return ManualPlan("test", tuple(axes), batch_axis, tuple((k.replace("__", "."), tuple(v)) for k, v in params.items()))


PLANS_2D = {
    # one weight sharded on two dims over two axes (2-D tensor parallel)
    "2d-weight": plan(("a", "b"), None, fc1__weight=["S(0)", "S(1)"], fc2__weight=["S(1)", "R"]),
    # the same dim over both axes (nested chunks: 24 rows -> 12 per a -> 6 per b)
    "nested-dim": plan(("a", "b"), None, fc1__weight=["S(0)", "S(0)"], fc1__bias=["S(0)", "S(0)"],
                       fc2__weight=["S(1)", "S(1)"]),
    # FSDP-like on the batch axis, Megatron on the other
    "fsdp-x-tp": plan(("dp", "tp"), "dp", fc1__weight=["S(1)", "S(0)"], fc1__bias=["R", "S(0)"],
                      fc2__weight=["S(0)", "S(1)"], fc2__bias=["S(0)", "R"]),
    # sharded parameters on the batch axis only, replicated on the other axis
    "zero-x-replica": plan(("dp", "r"), "dp", fc1__weight=["S(0)", "R"], fc2__weight=["S(1)", "R"]),
}


@pytest.mark.parametrize("name", sorted(PLANS_2D))
@pytest.mark.parametrize("mesh_sizes", [(2, 2), (3, 2), (2, 5)])
def test_mlp_transitions_on_2d_meshes(name, mesh_sizes):
    """Uneven shards (24 over 5, 5 over 2) and empty ones (7 rows over 3 x ... , 5 over 2 x 3)."""
    p = PLANS_2D[name]
    mesh = ",".join(f"{a}={n}" for a, n in zip(p.mesh_axes, mesh_sizes))
    model, batch, loss_fn = _mlp_batch()
    check(model, batch, loss_fn, mesh, p)


def test_non_contiguous_batch_input():
    model, (x, y), loss_fn = _mlp_batch()
    x_nc = x.t().contiguous().t()
    assert not x_nc.is_contiguous()
    check(model, (x_nc, y), loss_fn, "dp=2,tp=2", PLANS_2D["fsdp-x-tp"])


def test_zero_element_parameter_shards():
    """A weight with 2 rows over 4 ranks of one axis: two ranks hold 0-row shards."""

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc1 = nn.Linear(6, 2)
            self.fc2 = nn.Linear(2, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    batch = (torch.randn(4, 6), torch.randn(4, 3))
    progs = check(Tiny(), batch, F.mse_loss, "dp=2,tp=4",
                  plan(("dp", "tp"), "dp", fc1__weight=["R", "S(0)"], fc1__bias=["R", "S(0)"], fc2__weight=["R", "S(1)"]))
    assert sorted(p.state["fc1.weight"].shape[0] for p in progs.values()) == [0, 0, 0, 0, 1, 1, 1, 1]


class _PartialThen(nn.Module):
    """y = x @ W.T with W sharded on its input features: y is a Partial sum, then used replicated
    (tanh: P -> R, all_reduce) or added to a sharded bias (P -> S)."""

    def __init__(self, to_shard: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 6, bias=False)
        self.b = nn.Parameter(torch.randn(6))
        self.to_shard = to_shard

    def forward(self, x):
        y = self.fc(x)
        return (y + self.b) if self.to_shard else torch.tanh(y) * self.b


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_partial_to_replicate_has_an_identity_gradient(mesh):
    """Forward: one all_reduce on tp; backward: the gradient of the partial sum is the replicated
    gradient itself (no collective on tp)."""
    axes = tuple(a.split("=")[0] for a in mesh.split(","))
    p = plan(axes, "dp" if "dp" in axes else None, fc__weight=[*(["R"] if "dp" in axes else []), "S(1)"])
    batch = (torch.randn(5, 8), torch.randn(5, 6))
    progs = check(_PartialThen(False), batch, F.mse_loss, mesh, p)
    tp_calls = [c for c in progs[0].collectives() if "adaptdist:tp" in c]
    assert len(tp_calls) == 1 and "all_reduce" in tp_calls[0]


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_partial_to_shard_gradient(mesh):
    """Forward: the partial sum y = x W^T (W sharded on its input features) becomes a shard of its
    columns to meet the sharded bias: a reduce_scatter. Backward: y's gradient arrives sharded by columns; DTensor would
    all_gather it back into the full gradient of the partial sum; in the joint graph the weight's
    gradient is computed from the sharded gradient instead (rows of W's gradient) and one all_to_all
    moves it into W's column shards, a 1/world of the all_gather's volume. Exactly one backward
    collective on tp, and every gradient equals eager."""
    axes = tuple(a.split("=")[0] for a in mesh.split(","))
    dp = ["R"] if "dp" in axes else []
    p = plan(axes, "dp" if "dp" in axes else None, fc__weight=[*dp, "S(1)"], b=[*dp, "S(0)"])
    batch = (torch.randn(5, 8), torch.randn(5, 6))
    progs = check(_PartialThen(True), batch, F.mse_loss, mesh, p)
    tp_calls = [c for c in progs[0].collectives() if "adaptdist:tp" in c]
    backward = [c for c in tp_calls if "all_gather" in c or "all_to_all" in c]
    assert len(backward) == 1, tp_calls
    assert any("reduce_scatter" in c for c in tp_calls)  # P -> S in forward: each rank gets its block of the sum


def test_readme_plan_file_is_exact(tmp_path):
    """The schema-2 plan file shown in README.md (FSDP-like table on dp, vocabulary-parallel on tp)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "mesh: [dp, tp]" in b)
    f = tmp_path / "plan.yaml"
    f.write_text("\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines()))
    import adaptdist.models.gpt as gpt

    plan = ManualPlan.parse(str(f), gpt)
    assert plan.mesh_axes == ("dp", "tp") and plan.batch_axis == "dp"
    model, batch, loss_fn = tiny_gpt(5, 8)
    check(model, batch, loss_fn, "dp=2,tp=2", plan)
