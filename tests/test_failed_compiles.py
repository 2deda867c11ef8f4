"""adaptdist/compiler/failed_compiles.py: a rank whose Dynamo trace fails announces it (one process; the two-rank run
is test_dynamo_backend.py's test_a_rank_whose_trace_fails_on_its_input_shape_stops_every_rank_at_once)."""

import importlib.util
import json
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from adaptdist import _torch_compat as compat
from adaptdist.compiler import failed_compiles
from adaptdist.compiler.dynamo_capture import classify_inputs
from adaptdist.errors import RankInputMismatchError
from adaptdist.runtime import graph_agreement as ga


class Recording:
    """A backend that records its graph's user inputs (as the adaptdist backend names them) and runs the graph."""

    announces_failed_compiles = True

    def __init__(self):
        self.inputs = []

    def __call__(self, gm, example_inputs):
        self.inputs += [(i.fqn, str(i.dtype).removeprefix("torch."), i.global_shape)
                        for i in classify_inputs(gm, example_inputs) if i.kind == "input"]
        return gm.forward


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _mlp():
    torch.manual_seed(0)
    return MLP()


def _reset(*callbacks):
    """``torch._dynamo.reset()``, which also drops every end-of-compile callback, then ``callbacks`` registered."""
    import torch._dynamo

    torch._dynamo.reset()
    for callback in callbacks:
        compat.on_dynamo_frame_compiled(callback)


@pytest.fixture
def recorded_failures():
    """Every compile's :func:`compat.dynamo_failed_compile`, from an end-of-compile callback (re-registered by
    ``seen.reset()``)."""
    seen = []

    def record(_args):
        seen.append(compat.dynamo_failed_compile())

    class Seen(list):
        def reset(self):
            _reset(record)

    seen = Seen()
    seen.reset()
    try:
        yield seen
    finally:
        _reset()


def test_a_failed_trace_is_seen_with_its_backend_frame_and_inputs(recorded_failures):
    backend = Recording()
    model = _mlp()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(torch.randn(4, 12))
    assert recorded_failures == [None]  # a compile that succeeds
    with pytest.raises(Exception, match="must have same reduction dim"):
        compiled(torch.randn(4, 11))
    got_backend, code, f_locals, error = recorded_failures[-1]
    assert got_backend is backend and code.co_name == "forward" and "must have same reduction dim" in str(error)
    # the failed rank names its inputs as the compiled rank's backend does
    assert failed_compiles.frame_input_shapes(f_locals) == [("L['x']", "float32", (4, 11))]
    assert backend.inputs == [("L['x']", "float32", (4, 12))]
    assert failed_compiles._trains(f_locals)
    # a torch.nn module (nn.Sequential) is compiled as external_utils.wrap_inline's inner(), its input args[0]
    recorded_failures.reset()
    sequential = torch.compile(nn.Sequential(nn.Linear(12, 3)), backend=backend, dynamic=False)
    sequential(torch.randn(4, 12))
    with pytest.raises(Exception, match="must have same reduction dim"):
        sequential(torch.randn(4, 11))
    assert recorded_failures[-1][1].co_name == "inner" and failed_compiles._trains(recorded_failures[-1][2])
    assert backend.inputs[-1] == ("L['args'][0]", "float32", (4, 12))
    assert failed_compiles.frame_input_shapes(recorded_failures[-1][2]) == [("L['args'][0]", "float32", (4, 11))]
    # an error the caller's own `except` block is handling is not the compile's
    recorded_failures.reset()
    try:
        raise ValueError("the caller's own")
    except ValueError:
        torch.compile(model, backend=backend, dynamic=False)(torch.randn(4, 12))
    assert recorded_failures[-1] is None


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_hugging_face_forward_under_decorators_names_its_keyword_inputs_as_dynamo(recorded_failures):
    """GPT-2's forward is compiled as its decorators' ``wrapper(self, *args, **kwargs)`` frame: the inputs are
    ``L['kwargs'][...]`` on the rank that fails as on the rank that compiles."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=31, n_positions=16)).eval()
    backend = Recording()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(inputs_embeds=torch.randn(4, 6, 32))
    recorded_failures.reset()
    with pytest.raises(Exception, match="broadcast"):
        compiled(inputs_embeds=torch.randn(4, 6, 31))
    f_locals = recorded_failures[-1][2]
    assert backend.inputs == [("L['kwargs']['inputs_embeds']", "float32", (4, 6, 32))]
    assert failed_compiles.frame_input_shapes(f_locals) == [("L['kwargs']['inputs_embeds']", "float32", (4, 6, 31))]


def test_the_failing_rank_announces_and_raises_the_agreed_error(monkeypatch):
    """In a world of 2 (a fake process group), the callback announces FAILED with the digest and the JSON of this
    rank's input shapes, and raises what the announcement raises; Dynamo compiles normally afterwards (its pending
    callback count restored). A graph of another backend, or of no trainable parameter, announces nothing."""
    import torch._dynamo

    calls = []

    def announce(kind, gid, describe, inputs=None):
        calls.append((kind, gid, describe(), inputs()))
        raise RankInputMismatchError("agreed on every rank")

    monkeypatch.setattr(ga, "announce", announce)
    announcing = failed_compiles.announce_failed_compile
    _reset(announcing)
    compat.fake_process_group(1, 2)
    try:
        model = _mlp()
        # the typed error itself reaches the caller (was: wrapped in Dynamo's InternalTorchDynamoError)
        with pytest.raises(RankInputMismatchError, match="agreed on every rank") as caught:
            torch.compile(model, backend=Recording(), dynamic=False)(torch.randn(4, 11))
        assert type(caught.value).__name__ == "RankInputMismatchError", type(caught.value).__mro__
        assert "RankInputMismatchError: agreed on every rank" in "".join(
            traceback.format_exception_only(type(caught.value), caught.value))
        [(kind, gid, text, shapes)] = calls
        assert kind == ga.FAILED and gid == ga.graph_id(shapes)
        assert json.loads(shapes) == [["L['x']", "float32", [4, 11]]]
        assert "report that its compile of frame forward" in text and "must have same reduction dim" in text
        # Dynamo compiles afterwards (the pending callback count was taken back), and runs the callbacks
        assert torch.compile(model, backend=Recording(), dynamic=False)(torch.randn(4, 12)).shape == (4, 3)
        with pytest.raises(Exception):
            torch.compile(model, backend=Recording(), dynamic=False)(torch.randn(4, 10))
        assert len(calls) == 2
        # another backend's failure, and a frame without trainable parameters: not announced
        _reset(announcing)
        with pytest.raises(Exception, match="must have same reduction dim"):
            torch.compile(model, backend=lambda gm, ex: gm.forward, dynamic=False)(torch.randn(4, 11))
        model.requires_grad_(False)
        _reset(announcing)
        with pytest.raises(Exception, match="must have same reduction dim"):
            torch.compile(model, backend=Recording(), dynamic=False)(torch.randn(4, 11))
        assert len(calls) == 2
    finally:
        dist.destroy_process_group()
        _reset()


def test_the_ranks_that_compiled_raise_the_typed_error_too(monkeypatch):
    """On the ranks whose compile reached the adaptdist backend, the agreement's RankInputMismatchError (raised
    before any collective of the compile) reaches the caller as itself, not in Dynamo's BackendCompilerFailed."""
    import adaptdist

    def announce(kind, gid, describe, inputs=None):
        raise RankInputMismatchError(f"rank 1 could not compile ({kind})")

    monkeypatch.setattr(ga, "announce", announce)
    _reset()
    compat.fake_process_group(0, 2)
    try:
        compiled = torch.compile(_mlp(), backend=adaptdist.backend(plan="dp"), dynamic=False)
        with pytest.raises(RankInputMismatchError, match="rank 1 could not compile") as caught:
            compiled(torch.randn(4, 12))
        assert type(caught.value).__name__ == "RankInputMismatchError", type(caught.value).__mro__
    finally:
        dist.destroy_process_group()
        _reset()


def test_an_agreed_error_the_backend_raises_is_not_a_failed_trace(recorded_failures):
    """An agreed error the backend passes through Dynamo (compat.through_dynamo) is the backend's, as a
    BackendCompilerFailed was: the rank does not announce a failed compile after it (it did: a second, confusing
    RankDivergenceError on the ranks that compiled)."""
    def backend(gm, example_inputs):
        raise compat.through_dynamo(RankInputMismatchError("agreed"))

    backend.announces_failed_compiles = True
    recorded_failures.reset()
    with pytest.raises(RankInputMismatchError, match="agreed"):
        torch.compile(_mlp(), backend=backend, dynamic=False)(torch.randn(4, 12))
    assert recorded_failures[-1] is None


def test_an_error_passed_through_dynamo_pickles_as_the_plain_error():
    """A rank's error crosses processes (to its launcher) pickled: as adaptdist's own type and message."""
    import pickle

    passing = compat.through_dynamo(RankInputMismatchError("L['x'] differs"))
    assert isinstance(passing, RankInputMismatchError) and passing is not None
    back = pickle.loads(pickle.dumps(passing))
    assert type(back) is RankInputMismatchError and str(back) == "L['x'] differs"
