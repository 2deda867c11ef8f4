import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture
from adaptdist.errors import CaptureError
from models import mlp, tiny_gpt


def test_joint_graph_records_roles_and_matches_eager():
    model, batch, loss_fn = tiny_gpt(4, 8)
    cg = capture(model, batch, loss_fn)
    phs = list(cg.gm.graph.find_nodes(op="placeholder"))
    assert [gmeta.get_role(p) for p in phs][-2:] == ["batch", "batch"]
    assert cg.tied == {"head.weight": "tok_emb.weight"}
    assert "head.weight" not in cg.param_fqns
    assert all(isinstance(p.meta["val"], torch.Tensor) for p in phs)
    assert cg.gm.graph.output_node().meta[gmeta.OUTPUT_ROLES][cg.loss_output_index] == "loss"
    params = dict(model.named_parameters())
    outs = cg.gm(*[params[f] for f in cg.input_fqns], *batch)
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    assert outs[cg.loss_output_index].item() == pytest.approx(loss.item(), abs=1e-6)
    for fqn, i in cg.grad_output_index.items():
        torch.testing.assert_close(outs[i], params[fqn].grad, atol=1e-6, rtol=1e-5)


def test_capture_of_fake_and_meta_models_needs_no_real_memory():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    x = torch.empty(8, 4096, device="meta")
    y = torch.empty(8, 4096, device="meta")
    cg = capture(model, (x, y), F.mse_loss)
    v = next(iter(cg.gm.graph.find_nodes(op="placeholder"))).meta["val"]
    assert tuple(v.shape) == (4096, 4096)
    assert cg.param_fqns == ["weight", "bias"]


def test_buffers_and_frozen_params_are_recorded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
            self.register_buffer("scale", torch.full((3,), 2.0))

        def forward(self, x):
            return self.a(x) * self.scale + self.frozen

    cg = capture(M(), (torch.randn(2, 3), torch.randn(2, 3)), F.mse_loss)
    assert cg.param_fqns == ["a.weight", "a.bias"]
    assert cg.frozen_param_fqns == ["frozen"]
    assert cg.buffer_fqns == ["scale"]
    assert cg.input_fqns == ["a.weight", "a.bias", "frozen", "scale"]


def test_non_scalar_loss_is_refused():
    model, batch, _ = mlp()
    with pytest.raises(CaptureError, match="scalar"):
        capture(model, batch, lambda out, t: F.cross_entropy(out, t, reduction="none"))


def test_bad_batch_is_refused():
    model, (x, y), loss_fn = mlp()
    with pytest.raises(CaptureError, match="tuple"):
        capture(model, x, loss_fn)
    with pytest.raises(CaptureError, match="dim 0"):
        capture(model, (x, y[:3]), loss_fn)


def test_data_dependent_control_flow_names_the_construct():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: cannot be captured on fake tensors
                return self.fc(x)
            return -self.fc(x)

    with pytest.raises(CaptureError) as e:
        capture(Branchy(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)
    assert "Branchy" in str(e.value) and "x.sum() > 0" in str(e.value)


def test_unused_parameter_is_captured_without_gradient_and_named(caplog):
    """A parameter the loss does not reach (once a CaptureError) is a frozen input with no gradient output,
    named in one logged line (tests/test_capture_edge_cases.py trains such a model against eager)."""
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    with caplog.at_level("WARNING", logger="adaptdist.compiler"):
        cg = capture(Unused(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)
    assert cg.param_fqns == ["used.weight", "used.bias"] and cg.unused_param_fqns == ["unused.weight", "unused.bias"]
    assert cg.frozen_param_fqns == cg.unused_param_fqns and sorted(cg.grad_output_index) == sorted(cg.param_fqns)
    assert [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()] == [
        "adaptdist: 2 trainable parameter(s) of Unused receive no gradient from the loss (unused.weight, unused.bias): "
        "trained as unused (as DDP's find_unused_parameters=True): no gradient, kept unchanged by the optimizer as "
        "in eager (where their .grad stays None), saved in checkpoints"]


def test_loss_of_a_model_that_updates_buffers_is_the_loss():
    """torch 2.13's export signature names the first mutated buffer (BatchNorm's running_mean) as the loss
    output; capture takes the step's own output, so the program's loss is the loss."""
    import torch.nn as nn
    import torch.nn.functional as F

    from adaptdist.compiler.lowering import compile_model
    from adaptdist.annotations import ManualPlan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    want = F.cross_entropy(model(batch[0]), batch[1]).item()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    cg = capture(model, batch, F.cross_entropy)
    roles = gmeta.get_output_roles(cg.gm.graph.output_node())
    assert roles[:3] == ["buffer:1.running_mean", "buffer:1.running_var", "buffer:1.num_batches_tracked"]
    assert roles[3] == "loss"
    prog = compile_model(model, batch, F.cross_entropy, 1, ManualPlan.parse("dp"))[0]
    out = prog(*[prog.state[f] for f in prog.input_fqns], *batch)
    assert abs(float(out[prog.loss_index]) - want) < 1e-6


def test_one_tensor_registered_as_two_buffers_lowers_like_eager():
    """``register_buffer("a", t); register_buffer("b", t)``: named_buffers() drops the second name, the
    captured graph keeps it as an input; lowering finds it under both names (once a KeyError), and the
    programs' loss and gradients on 2 simulated ranks equal eager's."""
    import torch.nn as nn
    import torch.nn.functional as F

    from passutil import simulate

    class TwoNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            t = torch.full((4,), 0.5)
            self.register_buffer("a", t)
            self.register_buffer("b", t)

        def forward(self, x):
            return self.fc(x) * self.a + self.b

    torch.manual_seed(0)
    model = TwoNames()
    batch = (torch.randn(6, 4), torch.randn(6, 4))
    progs, outs = simulate(model, batch, F.mse_loss, 2)
    loss = F.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    for r, prog in progs.items():
        assert "a" in prog.input_fqns and "b" in prog.input_fqns
        assert abs(float(outs[r][0]) - loss.item()) < 1e-6
        grads = {role.removeprefix("grad:"): v for role, v in zip(prog.output_roles, outs[r]) if role.startswith("grad:")}
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0)


def test_a_shape_bug_is_one_error_naming_the_module_without_fake_tensor_logs(capfd, caplog):
    """A shape bug in the user's model (Linear(16, 32) then Linear(64, 4)): one CaptureError naming the module and
    both shapes, and none of FakeTensorMode's "failed while attempting to run meta" tracebacks on stderr."""
    import torch.nn.functional as F

    from adaptdist.errors import CaptureError

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    with pytest.raises(CaptureError) as e, caplog.at_level("ERROR"):
        capture(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))), F.cross_entropy)
    msg = str(e.value)
    assert "in module '2' (Linear(in_features=64, out_features=4" in msg and "[8, 32] X [64, 4]" in msg, msg
    assert "runs eagerly on this batch" in msg
    err = capfd.readouterr().err + "".join(r.getMessage() for r in caplog.records)
    assert "failed while attempting to run meta" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("model,batch,want,advice", [
    # the model is a torch module itself: no frame of the user's code on the traceback
    (lambda: torch.nn.Linear(16, 4), lambda: (torch.randn(8, 12), torch.randint(0, 4, (8,))),
     "failed in the model's own forward (Linear(in_features=16, out_features=4", "model(*batch[:-1])"),
    # torch's loss on a target of the wrong shape
    (lambda: torch.nn.Linear(16, 4), lambda: (torch.randn(8, 16), torch.randint(0, 4, (8, 3))),
     "failed in the loss function cross_entropy", "loss_fn(model(*batch[:-1]), batch[-1])"),
    # one batch tensor too many for the model's forward
    (lambda: torch.nn.Linear(16, 4), lambda: (torch.randn(8, 16), torch.randn(8, 16), torch.randint(0, 4, (8,))),
     "failed calling the model Linear on the batch's inputs", "every batch tensor but the last"),
    # a nested torch module: its qualified name and class
    (lambda: torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(30))),
     lambda: (torch.randn(8, 16), torch.randint(0, 4, (8,))), "failed in module '0.1' (LayerNorm((30,)",
     "that module receives"),
])
def test_a_failure_without_a_user_frame_names_the_part_that_failed(model, batch, want, advice):
    """When every frame of the traceback is torch's, the CaptureError names the module (qualified name, class),
    the model's own forward, the call of the model or the loss function, and what to check: never
    "(no user frame)"."""
    import torch.nn.functional as F

    from adaptdist.errors import CaptureError

    with pytest.raises(CaptureError) as e:
        capture(model(), batch(), F.cross_entropy)
    msg = str(e.value)
    assert want in msg and advice in msg and "no user frame" not in msg, msg
