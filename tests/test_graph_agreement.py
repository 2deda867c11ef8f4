"""adaptdist/runtime/graph_agreement.py: the announcement that starts every compile, forward and backward of a
compiled graph (one process; the two-rank case is test_dynamo_backend.py's
test_ranks_that_diverge_after_the_first_step_stop_with_a_typed_error)."""

import torch

from adaptdist.compiler.dynamo_backend import _first_graph_text, _graph_text, _user_lines
from adaptdist.errors import PlanMismatchError, RankDivergenceError, RankInputMismatchError
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


def test_a_failed_compile_with_other_input_shapes_is_named_as_an_input_mismatch():
    """Issue 14: rank 1's Dynamo trace failed on its inputs (FAILED) while rank 0 compiled: the error names the
    input, both shapes and the rank, comparing only the inputs both ranks name (the failed rank names every tensor
    of its frame, in its own order)."""
    rows = [(ga.COMPILE, 0), (ga.FAILED, 99)]
    texts = [ga.unit_text(ga.COMPILE, "frame forward (m.py:5)"),
             ga.unit_text(ga.FAILED, "frame forward (m.py:5) (RuntimeError: a and b must have same reduction dim)")]
    shapes = [[("L['x']", "float32", (4, 12))], [("L['mask']", "bool", (4,)), ("L['x']", "float32", (4, 11))]]
    error = ga.divergence_error(rows, texts, shapes, rank=0)
    assert isinstance(error, RankInputMismatchError) and isinstance(error, RankDivergenceError)
    text = str(error)
    assert "rank 1 could not compile the model on its inputs" in text
    assert "L['x'] is float32[4, 12] on rank 0 but float32[4, 11] on rank 1" in text
    assert "pad or bucket them to fixed shapes" in text and "(this is rank 0)" in text
    assert "rank 1: about to report that its compile of frame forward (m.py:5) (RuntimeError: a and b" in text
    # the same shapes: not an input mismatch, but rank 1's failure is still named
    same = ga.divergence_error(rows, texts, [shapes[0], shapes[0]], rank=1)
    assert type(same) is RankDivergenceError and "rank 1 could not compile the model" in str(same)
    assert "(this is rank 1)" in str(same)
    # a rank that did not say its inputs: no comparison
    assert type(ga.divergence_error(rows, texts, [shapes[0], None], rank=0)) is RankDivergenceError
    # a compile that succeeds on other shapes meets the others' backward: an input mismatch too
    graph = [(ga.BACKWARD, 7), (ga.COMPILE, 0)]
    other = ga.divergence_error(graph, ["run the backward of G", "compile a new graph for frame f"],
                                [[("L['x']", "float32", (4, 12))], [("L['x']", "float32", (3, 12))]], rank=1)
    assert isinstance(other, RankInputMismatchError) and "drop_last=True" in str(other)
    assert "the ranks reached different compiled graphs because their inputs differ" in str(other)
