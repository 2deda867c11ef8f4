"""The eager-call guard of the backend (adaptdist/compiler/graphless_calls.py): inside a call compiled by an adaptdist
backend on several ranks, a torch.nn module with trainable parameters that Dynamo runs eagerly is refused, naming it,
why and what to try; nothing legitimate is refused. One process: a fake process group of 2 ranks and a stub backend
that carries the adaptdist backend's marker and runs each graph as it is (Dynamo decides what runs eagerly before any
backend runs; the real backend on 2 gloo ranks: tests/test_skipped_frames.py)."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from adaptdist import _torch_compat as compat
from adaptdist.compiler import graphless_calls
from adaptdist.errors import CaptureError


class StubBackend:
    """Runs each Dynamo graph as it is; counts them. ``refuses_eager_module_calls`` as AdaptdistBackend's."""

    refuses_eager_module_calls = True

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


class OtherBackend(StubBackend):
    refuses_eager_module_calls = False


@pytest.fixture
def two_fake_ranks():
    torch._dynamo.reset()
    compat.fake_process_group(0, 2)
    graphless_calls.guard_eager_module_calls()
    try:
        yield
    finally:
        compat.remove_global_forward_pre_hook(graphless_calls.refuse_eager_module_call)
        dist.destroy_process_group()
        torch._dynamo.reset()


def _sequential(momentum):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Linear(8, 2))


class WithCumulativeBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


class OwnParameterWithBreak(nn.Module):
    """A user module with a parameter of its own and a graph break in its forward: Dynamo compiles its forward as a
    frame of its own (the parameter reaches a graph), though its call itself runs eagerly."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x) * self.scale
        torch._dynamo.graph_break()
        return h * self.scale


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = OwnParameterWithBreak()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_a_sequential_with_cumulative_batch_norm_is_refused_naming_module_cause_and_fix(two_fake_ranks):
    backend = StubBackend()
    with pytest.raises(CaptureError) as e:
        torch.compile(_sequential(None), backend=backend)(torch.randn(6, 4))
    msg = str(e.value)
    assert backend.graphs == 0  # Dynamo ran the whole call eagerly: no graph reached the backend
    for part in ("module '0' (Linear) eagerly", "BatchNorm '1' has momentum=None", "float(self.num_batches_tracked)",
                 "On 2 ranks", "never be reduced", "momentum=0.1", "adaptdist train", "DistributedDataParallel"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("affine", [True, False])
def test_cumulative_batch_norm_inside_a_model_is_refused_naming_it(two_fake_ranks, affine):
    """Without affine parameters the eager BatchNorm still updates its running statistics from this rank's rows."""
    model = WithCumulativeBN()
    model.bn = nn.BatchNorm1d(8, momentum=None, affine=affine)
    state = "parameters' gradients would never be reduced" if affine else "running statistics would come from each rank"
    with pytest.raises(CaptureError, match=r"module 'bn' \(BatchNorm1d\) eagerly.*BatchNorm 'bn' has momentum=None.*"
                                           + state):
        torch.compile(model, backend=StubBackend())(torch.randn(6, 4))


@pytest.mark.parametrize("case", ["momentum=0.1", "user-module-break", "eval-no-grad", "other-backend", "eager"])
def test_legitimate_calls_are_not_refused(two_fake_ranks, case):
    x = torch.randn(6, 4)
    backend = StubBackend()
    if case == "momentum=0.1":
        model = _sequential(0.1)
        torch.compile(model, backend=backend)(x).sum().backward()
        assert backend.graphs >= 1
    elif case == "user-module-break":
        torch.manual_seed(0)
        model = Outer()
        want = model(x)
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, want)
        assert backend.graphs >= 2  # the break splits the graph: the parameter reached a graph both sides
    elif case == "eval-no-grad":
        model = _sequential(None).eval()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
    elif case == "other-backend":
        torch.compile(_sequential(None), backend=OtherBackend())(x).sum().backward()
    else:  # the model called eagerly, outside any compiled call, after a compiled one
        model = _sequential(None)
        torch.compile(nn.Linear(4, 4), backend=backend)(x)
        model(x).sum().backward()


def test_the_guard_installs_once_and_only_on_several_ranks():
    from torch.nn.modules import module as nn_module

    def count():
        return sum(h is graphless_calls.refuse_eager_module_call for h in nn_module._global_forward_pre_hooks.values())

    graphless_calls.guard_eager_module_calls()  # no process group: one rank, nothing to guard
    assert count() == 0
    compat.fake_process_group(0, 2)
    try:
        graphless_calls.guard_eager_module_calls()
        graphless_calls.guard_eager_module_calls()
        assert count() == 1
    finally:
        compat.remove_global_forward_pre_hook(graphless_calls.refuse_eager_module_call)
        dist.destroy_process_group()
    assert count() == 0


@pytest.mark.parametrize("by_name", [False, True], ids=["backend-object", "backend-by-name"])
def test_the_real_backend_is_recognised_object_or_by_name(two_fake_ranks, by_name):
    """Dynamo runs this call wholly eagerly, so the backend itself never runs: the adaptdist backend (an object, or
    ``backend="adaptdist"`` through torch's registry) is found behind torch.compile's wrapper all the same."""
    import adaptdist

    backend = "adaptdist" if by_name else adaptdist.backend(plan="dp")
    with pytest.raises(CaptureError, match=r"module '0' \(Linear\) eagerly.*BatchNorm '1' has momentum=None"):
        torch.compile(_sequential(None), backend=backend)(torch.randn(6, 4))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


@pytest.mark.parametrize("backend_kind", ["adaptdist", "other"])
def test_a_frame_past_the_recompile_limit_is_refused(two_fake_ranks, backend_kind):
    """A new batch size at every call under dynamic=False: past torch._dynamo.config.recompile_limit Dynamo runs the
    whole frame uncompiled (RUN_ONLY, no backend visible on the thread); on several ranks each rank would then train
    its own model. Under another backend it runs eagerly, as torch does."""
    torch.manual_seed(0)
    model = TwoLayers()
    backend = StubBackend() if backend_kind == "adaptdist" else OtherBackend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for rows in (2, 3):
            compiled(torch.randn(rows, 4)).sum().backward()
        assert backend.graphs == 2
        if backend_kind == "other":
            compiled(torch.randn(5, 4)).sum().backward()
            return
        with pytest.raises(CaptureError) as e:
            compiled(torch.randn(5, 4))
    msg = str(e.value)
    assert backend.graphs == 2
    for part in ("module 'fc' (Linear) eagerly", "2 times", "recompile_limit", "On 2 ranks", "never be reduced",
                 "dynamic=None", "mark_dynamic"):
        assert part in msg, (part, msg)
