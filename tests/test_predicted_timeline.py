"""cost_models/timeline.py and the predicted SPMD row of `train --trace`: every collective the cost model counts
is drawn where the model puts it (an fsdp plan's all_gathers and reduce_scatters were missing: the row showed
only forward+backward, one wait and the optimizer)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.lowering import compile_model
from adaptdist.cost_models.estimate import estimate_programs
from adaptdist.cost_models.hardware import FixedCluster, LinkFigures
from adaptdist.cost_models.timeline import predicted_segments, segments_as_tuples
from adaptdist.runtime.trace import chrome_trace, merge_traces
from adaptdist.runtime.trace_view import predicted_spmd_timeline_spans, predicted_steps, timeline_html
from models import mlp


def _clusters():
    gpus = dataclasses.replace(FixedCluster.uniform([("h0", 2)], kind="cuda"),
                               intra_host=LinkFigures("intra_host", 450e9, 5e-6))
    return {"cpu": FixedCluster.uniform([("h", 2)]), "cuda": gpus}


@pytest.fixture(scope="module")
def fsdp_programs():
    model, batch, loss_fn = mlp(8)
    return compile_model(model, batch, loss_fn, 2, ManualPlan.parse("fsdp"))


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_predicted_fsdp_step_shows_every_collective_the_estimate_counts(fsdp_programs, kind):
    cluster = _clusters()[kind]
    est = estimate_programs(fsdp_programs, cluster, "sgd")
    segs = predicted_segments(fsdp_programs, cluster, "sgd")
    for r, e in est.ranks.items():
        colls = [g for g in segs[r] if g.kind == "collective"]
        assert [(g.name, g.op) for g in colls] == [(c.name, c.kind) for c in e.collectives]
        assert {"all_gather", "reduce_scatter"} <= {g.op for g in colls}, {g.op for g in colls}
        for g, c in zip(colls, e.collectives):
            assert g.end_s - g.start_s == pytest.approx(float(c.time_s))
        on_compute = [g for g in segs[r] if g.kind != "collective"]
        busy = sum(g.end_s - g.start_s for g in on_compute if g.kind in ("compute", "optimizer"))
        idle = sum(g.end_s - g.start_s for g in on_compute if g.kind == "wait")
        assert busy == pytest.approx(e.compute_s) and idle == pytest.approx(e.idle_s)
        assert max(g.end_s for g in segs[r]) == pytest.approx(e.step_s)
        assert on_compute[-1].kind == "optimizer" and on_compute[-1].end_s - on_compute[-1].start_s == \
            pytest.approx(e.optimizer_s)
        if kind == "cpu":  # gloo: each collective waited for right after its issue, none overlaps compute
            for g in colls:
                assert not any(h.kind == "compute" and h.start_s < g.end_s - 1e-12 and h.end_s > g.start_s + 1e-12
                               for h in on_compute)
    spans = predicted_spmd_timeline_spans(segments_as_tuples(segs))
    for r, e in est.ranks.items():
        bars = [s for s in spans if s.rank == r and s.kind == "collective"]
        assert len(bars) == len(e.collectives) and all(s.lane == "comm" for s in bars)
        assert {s.label() for s in bars} >= {"all_gather", "reduce_scatter"}
    assert predicted_steps(spans)[0].end_s == pytest.approx(est.step_s)


def test_the_trace_outputs_carry_the_predicted_collectives(fsdp_programs):
    from test_trace import _recorded

    cluster = _clusters()["cpu"]
    spans = predicted_spmd_timeline_spans(segments_as_tuples(predicted_segments(fsdp_programs, cluster, "sgd")))
    measured = merge_traces([_recorded(0).to_dict(), _recorded(1).to_dict()])
    doc = json.loads(json.dumps(chrome_trace(measured, spans)))
    cats = [e["cat"] for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000]
    assert cats.count("collective") == sum(1 for s in spans if s.kind == "collective") > 0
    page = timeline_html(measured, spans)
    assert "rank 0 collective" in page and "op all_gather" in page and "op reduce_scatter" in page
