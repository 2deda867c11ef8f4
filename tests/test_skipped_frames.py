"""A frame Dynamo skips (runs eagerly, uncompiled) never reaches the backend: on several ranks its parameters'
gradients would never be reduced, so every rank stops with an error naming the frame (never silently
unsynchronised training); on one rank eager is the single-process step and trains."""

import re

import pytest
import torch

import adaptdist
from adaptdist.models.zoo import TopKMoE
from adaptdist.runtime.launch import launch_local
from skipped_frame_workers import batch_ema_worker, bn_cumulative_worker, skipped_frame_worker


@pytest.mark.timeout(300)
@pytest.mark.parametrize("by_name", [False, True], ids=["backend-object", "backend-by-name"])
def test_a_skipped_frame_stops_every_rank_with_its_name(by_name):
    errors = launch_local(skipped_frame_worker, (by_name,), 2)
    for r in range(2):
        assert re.search(r"(?s)CaptureError: torch.compile skipped forward \(.*zoo.py line \d+\).*never be reduced"
                         r".*dense dispatch", errors[r]), (r, errors[r])


def test_one_rank_trains_a_skipped_frame_eagerly():
    torch.manual_seed(0)
    model = TopKMoE()
    x = torch.randn(2, 3, 8)
    want = model(x).sum()
    got = torch.compile(model, backend=adaptdist.backend(plan="dp"))(x).sum()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch_norm", ["local", "sync"])
def test_batch_norm_broken_by_a_graph_break_is_refused_not_run_eagerly(batch_norm):
    """BatchNorm(momentum=None) breaks the graph at its call, so Dynamo runs the whole BatchNorm eagerly on each
    rank (its weight's and bias's gradients never reduced): every rank stops at that eager call, naming the module,
    why and the fix."""
    errors = launch_local(bn_cumulative_worker, (batch_norm,), 2)
    for r in range(2):
        assert re.search(r"(?s)CaptureError: torch.compile ran module 'bn' \(BatchNorm2d\) eagerly.*BatchNorm 'bn' has "
                         r"momentum=None.*On 2 ranks.*never be reduced.*momentum=0.1", errors[r]), (r, errors[r])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sequential_run_eagerly_by_dynamo_is_refused_on_every_rank():
    """An nn.Sequential compiled directly whose BatchNorm has momentum=None: Dynamo runs the whole call eagerly and
    calls no backend (no adaptdist code ran: each rank trained its own model); every rank now stops, naming the
    first module with parameters, the BatchNorm and what to try."""
    errors = launch_local(bn_cumulative_worker, ("local", True), 2)
    for r in range(2):
        assert re.search(r"(?s)CaptureError: torch.compile ran module '0' \(Linear\) eagerly.*BatchNorm '1' has "
                         r"momentum=None.*float\(self.num_batches_tracked\).*On 2 ranks.*never be reduced.*"
                         r"momentum=0.1.*adaptdist train.*DistributedDataParallel", errors[r]), (r, errors[r])


@pytest.mark.timeout(300)
def test_a_buffer_updated_from_the_rows_is_refused_saying_so():
    """A running average of the batch kept in a buffer cannot be updated per rank under the all-ranks capture:
    the refusal says that, and what to do, instead of only vmap's broadcast error."""
    errors = launch_local(batch_ema_worker, (), 2)
    for r in range(2):
        assert re.search(r"A buffer updated in the forward from each rank's rows .*adaptdist train", errors[r]), (r, errors[r])


@pytest.mark.timeout(300)
def test_calls_that_run_no_adaptdist_graph_stop_and_a_step_counter_buffer_trains():
    """Dynamo skips a GRU's frame: the call runs eagerly, never reaching the backend, so every rank stops (it
    used to train each rank's own model silently). A buffer every rank updates alike (``self.n += 1``) trains equal to eager (its
    second step used to crash in the backward)."""
    from skipped_frame_workers import StepCounter, counter_batches, graphless_call_worker

    results = launch_local(graphless_call_worker, (), 2)
    torch.manual_seed(0)
    ref = StepCounter()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in counter_batches():
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for r in range(2):
        assert re.search(r"(?s)CaptureError: torch.compile runs a frame that calls nn.RNN/GRU/LSTM eagerly.*"
                         r"never be reduced.*allow_rnn", results[r]["rnn"]), (r, results[r]["rnn"])
        got = results[r]["counter"]
        assert isinstance(got, dict), (r, got)
        assert got["n"].item() == 3.0
        for k in ("fc.weight", "fc.bias"):
            torch.testing.assert_close(got[k], ref.state_dict()[k], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("msg, expected", [
    ("You tried to vmap over ApplyTemplate, but it does not have vmap support. Please override and implement the "
     "vmap staticmethod or set generate_vmap_rule=True", "custom torch.autograd.Function"),
    ("level > batched_level INTERNAL ASSERT FAILED at BatchedTensorImpl.cpp:177", "inside PyTorch"),
    ("Batching rule not implemented for aten::gru.input", "RNN"),
    ("something else entirely", "runs eagerly and under torch.vmap"),
])
def test_all_ranks_capture_failures_say_what_to_try(msg, expected):
    """Each kind of torch.vmap failure of the all-ranks capture gets its own advice, and every one names the
    front ends that capture one rank's program instead."""
    from adaptdist.compiler.dynamo_capture import _vmap_capture_hint

    hint = _vmap_capture_hint(msg.lower())
    assert expected in hint and "adaptdist train" in hint, hint


class _SiluFunction(torch.autograd.Function):
    """A user's custom autograd Function (as HF BLOOM's GeLU), which the all-ranks capture cannot vmap."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


def test_the_custom_function_refusal_names_where_the_user_calls_it():
    """Dynamo's error names only its generated ``ApplyTemplate``; the hint names the user's ``Fn.apply`` call
    (file, line, code) from the graph's stack traces (fresh-user report on HF BLOOM)."""
    from adaptdist.compiler.dynamo_capture import _autograd_function_sites, _vmap_capture_hint

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    lin = torch.nn.Linear(4, 4)
    torch._dynamo.reset()
    torch.compile(lambda x: _SiluFunction.apply(lin(x)).sum(), backend=keep)(torch.randn(2, 4))
    sites = _autograd_function_sites(graphs[0])
    assert len(sites) == 1 and "test_skipped_frames.py:" in sites[0] and "_SiluFunction.apply(" in sites[0], sites
    hint = _vmap_capture_hint("you tried to vmap over applytemplate", sites)
    assert f"called at {sites[0]}" in hint, hint
