"""The DCP checkpoint of sharded state on gloo: every rank's shard lands at its own offset of the global
tensor, including a dim sharded on two mesh axes (chunked in lowering order, uneven and empty shards)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.state_layout import shard_layout
from adaptdist.compiler.lowering import compile_model
from adaptdist.program import save_programs
from adaptdist.runtime.launch import launch_local
from dist_workers import checkpoint_worker

pytestmark = pytest.mark.slow  # every test here starts ranks (processes)


class MLP7(nn.Module):
    """12 -> 7 -> 5: 7 rows over tp=2 are 4 and 3, each over dp=3 is 2, 2, 0 and 1, 1, 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(12, 7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _assemble(shards: dict, layouts: dict, fqn: str) -> torch.Tensor:
    """The global tensor ``fqn`` from every rank's shard at the ranges the compiler gave it (each element
    written once: a rank whose shard is a replica writes the same values again)."""
    full = torch.full(layouts[0][fqn]["global_shape"], float("nan"))
    for r, t in shards.items():
        full[tuple(slice(s, e) for s, e in layouts[r][fqn]["ranges"])] = t
    return full


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # single-process load, on purpose
def test_dim_sharded_on_two_axes_checkpoints_at_its_offsets(tmp_path, capfd):
    """dp=3,tp=2 with dp the batch axis: fc1's rows are chunked by tp, then by dp (not the mesh's dp-then-tp
    order), fc2's columns likewise. The DCP checkpoint (model and AdamW state) and model.safetensors
    reassemble exactly to the shards the ranks hold, placed at the compiler's ranges, and writing them logs no
    DTensor warning about sequential all_gathers."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(7, 12, generator=g), torch.randint(0, 5, (7,), generator=g))
    plan = ManualPlan("nested", ("dp", "tp"), "dp", (("fc1.weight", ("S(0)", "S(0)")), ("fc1.bias", ("S(0)", "S(0)")),
                                                     ("fc2.weight", ("S(1)", "S(1)"))))
    model = MLP7()
    progs = compile_model(model, batch, F.cross_entropy, 6, plan, mesh="dp=3,tp=2")
    save_programs(progs, tmp_path / "programs")
    layouts = {r: shard_layout(p) for r, p in progs.items()}
    assert layouts[4]["fc1.weight"]["ranges"][0] == [4, 4]  # (dp=2, tp=0): an empty shard of 4 rows over dp=3
    res = launch_local(checkpoint_worker, (str(tmp_path / "programs"), str(tmp_path), batch), 6)
    # model.safetensors gathers each two-axis shard one axis at a time (runtime/checkpoint.gather_full): DTensor's
    # full_tensor() would log "2 sequential all_gather operations ... inconsistent results between ranks"
    err = capfd.readouterr().err
    assert "sequential all_gather" not in err, err

    fqns = [f for f, _ in model.named_parameters()]
    model_sd = {f: torch.empty_like(t) for f, t in model.named_parameters()}
    optim_sd = {f: {"exp_avg": torch.empty_like(t)} for f, t in model.named_parameters()}
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "checkpoints" / "step-00000001" / "dcp"))
    full = load_file(str(tmp_path / "model.safetensors"))
    for f in fqns:
        want = _assemble({r: res[r]["state"][f] for r in res}, layouts, f)
        assert not want.isnan().any(), f
        assert torch.equal(model_sd[f], want), f
        assert torch.equal(full[f], want), f
        assert torch.equal(optim_sd[f]["exp_avg"], _assemble({r: res[r]["exp_avg"][f] for r in res}, layouts, f)), f
