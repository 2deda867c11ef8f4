"""adaptdist/runtime/graph_agreement.py: the announcement that starts every compile, forward and backward of a
compiled graph (one process; the two-rank case is test_dynamo_backend.py's
test_ranks_that_diverge_after_the_first_step_stop_with_a_typed_error)."""

import torch

from adaptdist.compiler.dynamo_backend import _first_graph_text, _graph_text, _user_lines
from adaptdist.errors import PlanMismatchError, RankDivergenceError
from adaptdist.runtime import graph_agreement as ga


def test_graph_id_is_a_stable_int64_of_the_signature():
    a, b = ga.graph_id("abc [x float32[4, 16]]"), ga.graph_id("abc [x float32[3, 16]]")
    assert a == ga.graph_id("abc [x float32[4, 16]]") and a != b
    assert 0 <= a < 2**63 and 0 <= b < 2**63
    torch.tensor([ga.FORWARD, a], dtype=torch.int64)  # fits the announcement tensor


def test_announce_without_a_process_group_does_nothing():
    called = []
    ga.announce(ga.FORWARD, 1, lambda: called.append(1) or "")
    assert not called


def test_message_names_each_group_of_ranks_its_unit_and_the_fix():
    rows = [(ga.FORWARD, 7), (ga.COMPILE, 0), (ga.FORWARD, 7), (ga.BACKWARD, 7)]
    texts = [ga.unit_text(ga.FORWARD, "graph G of frame f (a.py:3)"), ga.unit_text(ga.COMPILE, "frame g (a.py:9)"),
             ga.unit_text(ga.FORWARD, "graph G of frame f (a.py:3)"), ga.unit_text(ga.BACKWARD, "graph G")]
    text = ga.divergence_message(rows, texts, rank=2)
    assert "ranks [0, 2]: about to run the forward of graph G of frame f (a.py:3)" in text
    assert "rank 1: about to compile a new graph for frame g (a.py:9)" in text
    assert "rank 3: about to run the backward of graph G" in text
    assert "rank 1 compiles a graph the other ranks do not" in text and "(this is rank 2)" in text
    assert "torch.where(cond, a, b)" in text and "drop_last=True" in text
    # no rank compiles: the ranks run different compiled graphs
    other = ga.divergence_message([(ga.FORWARD, 7), (ga.FORWARD, 8)], ["run the forward of A", "run the forward of B"], 0)
    assert "rank 0: about to run the forward of A; rank 1: about to run the forward of B" in other
    assert "compile a graph the other ranks do not" not in other
    assert issubclass(RankDivergenceError, PlanMismatchError)  # caught where a mismatch at the first step is


def test_descriptions_name_the_frame_the_code_lines_and_the_inputs():
    def f(x):
        y = x * 2
        return y + 1

    import torch._dynamo

    seen = []

    def backend(gm, example_inputs):
        seen.append(_user_lines(gm))
        return gm

    torch._dynamo.reset()
    torch.compile(f, backend=backend)(torch.ones(3))
    line = f.__code__.co_firstlineno
    assert seen == [f"{__file__}:{line + 1}-{line + 2}"]
    assert "after its graph break at line 11" in _first_graph_text(("torch_dynamo_resume_in_forward_at_11", "m.py", 11))
    assert _first_graph_text(("forward", "m.py", 5)) == " (the frame's first graph)"
    text = _graph_text("0123456789abcdef [L['x'] float32[4, 16]]", ("forward", "m.py", 5), torch.fx.GraphModule(
        torch.nn.Module(), torch.fx.Graph()))
    assert text == "graph 0123456789ab compiled earlier for frame forward (m.py:5), inputs [L['x'] float32[4, 16]]"
