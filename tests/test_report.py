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


def test_a_pipeline_report_has_its_collectives_time_memory_per_rank_and_stages_in_the_placements():
    """Real pp=2,tp=2 programs of the tiny GPT (the model file's TP_PLAN in the stages): the tp all-reduces of each
    stage program once per microbatch, the activations and gradients sent between stages with their bytes, the
    tied embedding's gradient sync; the placements' pp column names the stage (not R)."""
    import adaptdist.models.gpt as gpt_module
    import torch
    from adaptdist.annotations import ManualPlan
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.pipeline_lowering import PipelineOptions
    from adaptdist.compiler.pipeline_report import pipeline_comm_rows, pipeline_rank_rows, stage_holders
    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(8)
    m = 2
    programs = compile_model(model, batch, loss_fn, 4, ManualPlan.parse("tp", gpt_module), mesh="pp=2,tp=2",
                             pipeline=PipelineOptions(microbatches=m, schedule="1f1b"))
    act = (8 // m) * 8 * 32 * 4  # a microbatch's hidden states: rows x seq x dim float32
    rows = {r: pipeline_comm_rows(p) for r, p in programs.items()}
    r0 = {(x.kind, x.peer, x.what): x for x in rows[0]}
    assert r0[("send", "rank 2", "stage 0 activations")].n_bytes == m * act
    assert r0[("recv", "rank 2", "stage 0 gradients in")].n_bytes == m * act
    tp = r0[("all_reduce", "adaptdist:tp", "stage 0 forward")]
    assert tp.count % m == 0 and tp.count >= m and tp.n_bytes == tp.count * act  # Megatron's row-parallel outputs
    emb = programs[0].state["tok_emb.weight"]
    assert r0[("all_reduce", "ranks 0, 2", "gradient sync")].n_bytes == emb.numel() * 4  # tied: stages 0 and 1
    r2 = {(x.kind, x.peer, x.what) for x in rows[2]}
    assert ("recv", "rank 0", "stage 1 activations in") in r2 and ("send", "rank 0", "stage 1 gradients") in r2
    holders = stage_holders(programs)
    assert holders["tok_emb.weight"] == (0, 1) and holders["blocks.0.fc.weight"] == (0,)
    assert holders["blocks.1.fc.weight"] == (1,)
    ranks = pipeline_rank_rows(programs, "adamw")
    assert [x.stages for x in ranks] == [(0,), (0,), (1,), (1,)]
    assert ranks[0].params_bytes == sum(t.numel() * t.element_size() for t in programs[0].state.values())
    assert ranks[0].optimizer_bytes == 2 * ranks[0].grads_bytes > 0  # adamw: two moments
    plan = programs[0].plan
    page = render_report(title="t", manifest=MANIFEST, plan=plan, fqns=list(holders), hosts=["h"] * 4, estimate=None,
                         param_fqns=list(dict.fromkeys(f for p in programs.values() for f in p.param_fqns)),
                         pipeline=pipeline_view(plan, 4), pipeline_comm=rows, pipeline_ranks=ranks,
                         stage_holders=holders)
    h2 = _structure(page)
    assert h2 == ["Mesh", "Pipeline stages", "Parameter placements per layer", "Predicted time and memory per rank",
                  "Collectives per step", "Files"]
    table = page[page.index("<th>parameters</th>"):]
    assert "<tr><td>blocks.*.fc.weight</td><td>stage 0</td><td>S(0)</td>" in table
    assert "<tr><td>tok_emb.weight</td><td>stages 0,1</td>" in table
    assert not re.search(r"<tr><td>[^<]*</td><td>R</td>", table[:table.index("</table>")])  # no R on pp
    coll = page[page.index("<h2>Collectives per step"):page.index("<h2>Files")]
    assert f"<td>{m * act / 2**20:.3f}</td>" in coll and "adaptdist:tp" in coll and "gradient sync" in coll
    # the arithmetic of busy time: m x (F + B + W) + gradient sync of the rank's stage
    spec = NS(predicted_s={"step": 0.010}, stages_per_rank=1,
              stages=[NS(predicted_s={"forward": 1e-3, "backward": 2e-3, "weight": 1e-3, "grad_sync": 5e-4})])
    fake = {0: NS(plan=NS(pipeline=spec), stages=[NS(stage=0)], num_microbatches=2,
                  state={"w": torch.zeros(4)}, param_fqns=("w",))}
    (row,) = pipeline_rank_rows(fake, "sgd")
    assert row.busy_s == 2 * 4e-3 + 5e-4 and row.step_s == 0.010 and row.grads_bytes == 16
    assert "<td>1.500</td>" in render_report(title="t", manifest=MANIFEST, plan=_plan(), fqns=["w"], hosts=["h", "h"],
                                             estimate=None, pipeline_ranks=(row,))  # idle 10 - 8.5 ms


def test_rank_row_state_bytes_is_documented_and_sums_the_state():
    """RankRow.state_bytes: the sum of parameters, gradients and optimizer state, in bytes, and its docstring says
    so (unit and the parts, for readers of the report's 'state MiB' column)."""
    from adaptdist.compiler.pipeline_report import RankRow

    row = RankRow(0, (0,), None, None, params_bytes=100, grads_bytes=80, optimizer_bytes=160)
    assert row.state_bytes == 340
    doc = RankRow.state_bytes.__doc__ or ""
    assert "Bytes" in doc and all(k in doc for k in ("params_bytes", "grads_bytes", "optimizer_bytes")), doc
