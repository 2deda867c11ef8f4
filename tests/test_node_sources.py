"""The capture's record of where in user code each node came from (``_torch_compat.SOURCE_META``, read by
``graph_meta.source_of`` for error messages): the innermost frame of the user's code, whether the op is written
in a module's forward, in a free function or a method the forward calls, or in the loss function; never a frame
of torch or adaptdist, nor the line of the script that called the capture."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist import _torch_compat as compat
from adaptdist import graph_meta as gmeta
from adaptdist.compiler.capture import capture

CDIST = torch.ops.aten._cdist_forward.default


def _line(fn, text: str) -> int:
    """The line number of the line of ``fn``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, t in enumerate(lines) if text in t)


def distances(h):
    return torch.cdist(h, h)  # in a helper


class Net(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.lin, self.head, self.where = nn.Linear(4, 4), nn.Linear(6, 4), where

    def forward(self, x):
        h = self.lin(x)
        if self.where == "forward":
            d = torch.cdist(h, h)  # in forward
        elif self.where == "helper":
            d = distances(h)
        elif self.where == "method":
            d = self.pairwise(h)
        else:
            return h
        return self.head(d)

    def pairwise(self, h):
        return torch.cdist(h, h)  # in a method


def loss_with_distances(out, target):
    return F.mse_loss(out @ out.T, target) + torch.cdist(out, out).mean()  # in the loss


class Outer(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.body = Net(where)

    def forward(self, x):
        return self.body(x)


CASES = {
    "forward": (Net.forward, "# in forward", "in module `body` (Net)"),
    "helper": (distances, "# in a helper", "in module `body` (Net)"),
    "method": (Net.pairwise, "# in a method", "in module `body` (Net)"),
    "loss": (loss_with_distances, "# in the loss", "in the loss function"),
}


def _captured(where: str):
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    if where == "loss":
        return capture(Outer("none"), (x, torch.randn(6, 6)), loss_with_distances)
    return capture(Outer(where), (x, torch.randn(6, 4)), F.mse_loss)


@pytest.mark.parametrize("where", list(CASES))
def test_an_op_names_the_innermost_user_line(where):
    """Before: a helper's or method's op named the forward's line that called it, the loss's op no line."""
    fn, marker, part = CASES[where]
    cg = _captured(where)
    node = next(n for n in cg.gm.graph.nodes if n.target == CDIST)
    src = node.meta[compat.SOURCE_META]
    assert (src[2], src[3]) == (__file__, _line(fn, marker)), src
    assert src[4].endswith(marker), src
    text = gmeta.source_of(node)
    assert text.startswith(part) and f"test_node_sources.py:{_line(fn, marker)}:" in text, text
    # the op's backward takes its forward op's record
    back = [n for n in cg.gm.graph.nodes if "cdist_backward" in str(n.target)]
    assert back and all(n.meta[compat.SOURCE_META] == src for n in back), [n.meta.get(compat.SOURCE_META) for n in back]


def test_a_model_of_torch_modules_names_no_line_of_the_caller():
    """Ops only torch's code runs (nn.Sequential, F.mse_loss) name their module and no file: not this test's line
    that called the capture (the frames outside adaptdist's step are not the traced code)."""
    torch.manual_seed(0)
    cg = capture(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), (torch.randn(6, 4), torch.randn(6, 4)), F.mse_loss)
    recorded = [n.meta[compat.SOURCE_META] for n in cg.gm.graph.nodes if compat.SOURCE_META in n.meta]
    assert recorded
    assert all(src[2] == "" for src in recorded), [src for src in recorded if src[2]]
    assert {src[0] for src in recorded} >= {"0", "1", compat.LOSS_PATH}


def test_the_captured_graph_is_the_one_captured_without_sources(monkeypatch):
    """Recording sources changes node meta only: the joint graph's code is the same without the record."""
    import contextlib

    with_sources = _captured("helper").gm
    monkeypatch.setattr(compat, "_first_trace_sources", lambda root: contextlib.nullcontext([]))
    without = _captured("helper").gm
    assert not any(compat.SOURCE_META in n.meta for n in without.graph.nodes)
    assert with_sources.code == without.code
    assert [str(n.target) for n in with_sources.graph.nodes] == [str(n.target) for n in without.graph.nodes]


@pytest.mark.parametrize("path, kind", [
    (torch.nn.modules.linear.__file__, "library"),
    (inspect.getfile(inspect), "library"),
    (compat.__file__, "step"),
    (inspect.getfile(capture), "step"),
    (inspect.getfile(gmeta), "library"),
    ("<eval_with_key>.3", "library"),
    (__file__, "user"),
])
def test_code_kinds(path, kind):
    assert compat._code_kind(path) == kind
