"""compiler/report.py: report.html's structure (no browser here: the pictures were checked in headless Chromium),
parameters apart from buffers, the two predicted step times labelled, collectives per step, and the pipeline and
rank-mapping sections present exactly when the plan has them."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser
from types import SimpleNamespace as NS

from adaptdist.compiler.report import (collectives_section, param_and_buffer_fqns, pipeline_view,
                                       predictions_table, rank_mapping_view, render_report)
from adaptdist.placement import Replicate, Shard


class _Tags(HTMLParser):
    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.h2, self.errors = [], [], []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID and not tag.startswith("svg:"):
            self.stack.append(tag)
        self._in_h2 = tag == "h2"

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()
        self._in_h2 = False

    def handle_data(self, data):
        if self._in_h2:
            self.h2.append(data.strip())


def _structure(page: str) -> list[str]:
    """The h2 headings; asserts every tag outside the inlined SVGs is closed in order."""
    outside = re.sub(r"<svg.*?</svg>", "<svg></svg>", page, flags=re.S)
    p = _Tags()
    p.feed(outside)
    assert p.errors == [] and p.stack == [], (p.errors, p.stack)
    assert "<script" not in page and "http://" not in outside and "https://" not in outside
    return p.h2


def _coll(kind, group, nbytes, t):
    return NS(name=f"{kind}_x", kind=kind, group=group, group_size=2, n_bytes=nbytes, time_s=t, tier="intra-host",
              calibrated=False)


def _estimate(ranks=(0, 1)):
    mem = NS(params_bytes=2**20, grads_bytes=2**20, optimizer_state_bytes=2**21, activations_bytes=2**22,
             peak_bytes=2**23)
    colls = (_coll("all_reduce", "adaptdist:dp", 4 * 2**20, 0.004), _coll("all_reduce", "adaptdist:dp", 4, 0.0002))
    return NS(ranks={r: NS(rank=r, step_s=0.05, compute_s=0.045, communication_s=0.0042, idle_s=0.005,
                           optimizer_s=0.003, memory=mem, collectives=colls) for r in ranks})


def _plan(**extra):
    fields = dict(mesh={"dp": 2}, batch_axis="dp", name="dp", lowered=None,
                  param_placements={"w": [Replicate()], "blocks.0.b": [Shard(0)], "blocks.1.b": [Shard(0)]})
    fields.update(extra)
    return NS(**fields)


MANIFEST = {"adaptdist_version": "0", "torch_version": "2", "world_size": 2, "cluster_fingerprint": "f",
            "files": {"plan.json": "ab" * 32}}


def _render(plan, **kw):
    args = dict(title="t", manifest=MANIFEST, plan=plan, fqns=["w", "blocks.0.b", "blocks.1.b", "bn.running_mean"],
                hosts=["h", "h"], estimate=_estimate(), param_fqns=["w", "blocks.0.b", "blocks.1.b"])
    args.update(kw)
    return render_report(**args)


def test_buffers_are_not_listed_as_parameters():
    assert param_and_buffer_fqns(["w", "rm", "b"], ["w", "b"]) == (["w", "b"], ["rm"])
    page = _render(_plan())
    params_table = page[page.index("<th>parameters</th>"):page.index("Buffers and frozen")]
    assert "running_mean" not in params_table and "blocks.*.b" in params_table
    buffers = page[page.index("Buffers and frozen"):]
    assert "bn.running_mean" in buffers[:buffers.index("</table>")]


def test_the_two_predicted_step_times_are_labelled():
    ev = NS(compute_s=0.030, overhead_s=0.002, communication_s={"dp": 0.004}, step_s=0.036)
    table = predictions_table(ev, _estimate())
    assert "planner (ILP objective)" in table and "cost model (lowered programs)" in table
    assert "<b>36.000</b>" in table and "<b>50.000</b>" in table
    assert "not counted" in table and "3.000" in table  # the optimizer step: only the cost model has it
    manual = predictions_table(None, _estimate())
    assert "ILP" not in manual and "manual plan" in manual and "<b>50.000</b>" in manual
    assert predictions_table(None, None) == ""


def test_collectives_per_step_merge_alike_ranks():
    sec = collectives_section(_estimate((0, 1, 2, 3)))
    assert "<td>0-3</td><td>all_reduce</td><td>adaptdist:dp</td><td>2</td>" in sec
    assert "4.000" in sec  # MiB per step
    assert collectives_section(None) == ""


def test_report_structure_without_pipeline_or_mapping():
    h2 = _structure(_render(_plan()))
    assert h2 == ["Mesh", "Parameter placements per layer", "Predicted time and memory per rank",
                  "Predicted step time", "Collectives per step", "Files"]


def _pipeline_plan():
    st = lambda layers, f: NS(layers=tuple(layers), mesh={}, ranks=(), predicted_s={"forward": f, "backward": 2 * f})
    spec = NS(stages=(st(["emb", "blocks.0"], 0.01), st(["blocks.1", "head"], 0.012)), microbatches=2,
              schedule="gpipe", stages_per_rank=1, predicted_s={"step": 0.08, "bubble": 0.0033})
    devices = NS(rank_to_device=(1, 0), batch_rows=None, reason="the faster device takes the last stage")
    return _plan(mesh={"pp": 2}, batch_axis=None, pipeline=spec, devices=devices,
                 param_placements={"w": [Replicate()], "blocks.0.b": [Replicate()], "blocks.1.b": [Replicate()]})


def test_pipeline_and_rank_mapping_sections_when_the_plan_has_them():
    plan = _pipeline_plan()
    view = pipeline_view(plan, 2)
    assert [s.ranks for s in view.stages] == [(0,), (1,)]  # the default layout: stage group g = rank g
    acts = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)], 1: [(1, "F", 0), (1, "F", 1), (1, "B", 0),
                                                                     (1, "B", 1)]}
    mapping = rank_mapping_view(plan, ["cpu@a", "cpu@b"])
    assert [(r.rank, r.device, r.device_name) for r in mapping.rows] == [(0, 1, "cpu@b"), (1, 0, "cpu@a")]
    page = _render(plan, estimate=None, pipeline=dataclasses.replace(view, actions=acts), rank_mapping=mapping)
    h2 = _structure(page)
    assert h2 == ["Mesh", "Rank mapping", "Pipeline stages", "Parameter placements per layer", "Files"]
    sec = page[page.index("<h2>Pipeline stages"):page.index("<h2>Parameter placements")]
    assert "schedule gpipe, 2 microbatches" in sec and "bubble 3.300 ms" in sec and sec.count("<svg") == 1
    assert "emb … blocks.0 (2 layers)" in sec and "<th>forward ms</th><th>backward ms</th>" in sec
    assert "the faster device takes the last stage" in page and "<td>1: cpu@b</td>" in page


def test_no_sections_for_a_plan_without_pipeline_or_devices():
    plan = _plan()
    assert pipeline_view(plan, 2) is None and rank_mapping_view(plan, ["a", "b"]) is None
    page = _render(plan, pipeline=None, rank_mapping=None)
    assert "Pipeline stages" not in page and "Rank mapping" not in page
