"""`adaptdist zoo`: the model zoo (adaptdist/models/zoo.py) through the torch.compile backend and `adaptdist train`
against single-process eager PyTorch. CI runs a small sample (the MLP under auto and dp on 2 gloo ranks through
both front ends, Hugging Face GPT-2 under dp through the backend); the full sweep is a benchmark (-m bench)."""

import json

import pytest
import torch

from adaptdist.cli import main
from adaptdist.cli import zoo as zoo_cli
from adaptdist.errors import AdaptdistError, CaptureError, UsageError
from adaptdist.models import zoo


def test_unknown_model_is_a_usage_error_listing_the_names(capsys):
    assert main(["zoo", "--models", "mlp,no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "UsageError" in err and "'no-such-model'" in err
    assert all(name in err for name in zoo.ZOO)  # every name the zoo has
    with pytest.raises(UsageError, match="unknown 'pp'; choose from auto, dp, fsdp, tp"):
        zoo_cli.parse_names("dp,pp", zoo_cli.PLANS, "plans")
    with pytest.raises(UsageError, match="the zoo has: gpt, llama"):
        zoo.get("gpt3")


def test_the_zoo_has_the_models_the_issue_names():
    names = set(zoo.ZOO)
    assert len(names) >= 16
    assert {"gpt", "llama", "mlp", "mlp-dropout", "cnn", "moe", "moe-stacked", "dlrm", "hf-gpt2", "hf-llama",
            "hf-bert", "hf-t5", "hf-vit"} <= names and names & {"hf-mistral", "hf-qwen2"}
    combos = zoo_cli.combinations(["mlp", "cnn"], list(zoo_cli.PLANS), ["backend"])
    assert ("mlp", "tp", "backend") in combos and ("cnn", "tp", "backend") not in combos  # tp needs a TP_PLAN


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if not zoo.ZOO[n].requires])
def test_our_zoo_models_train_in_eager(name):
    """Each builds the same weights and batch twice, and every parameter gets a gradient."""
    m = zoo.get(name)
    model, batch, loss_fn = m.build(4)
    again, batch2, _ = m.build(4)
    assert all(torch.equal(a, b) for a, b in zip(batch, batch2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_hugging_face_models_build_from_configs():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    for name in ("hf-bert", "hf-t5"):
        model, batch, loss_fn = zoo.get(name).build(4)
        loss_fn(model(*batch[:-1]), batch[-1]).backward()
        assert all(p.grad is not None for p in model.parameters()), name


def test_a_missing_optional_package_is_listed_as_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(zoo, "unavailable", lambda m: "transformers is not installed" if m.requires else None)
    records = zoo_cli.sweep(["hf-vit"], ["dp", "fsdp"], ["backend", "train"], 2, 1, 0.1, tmp_path, 60)
    assert [r["outcome"] for r in records] == ["skipped"] * 4
    assert records[0]["error"] == "transformers is not installed"
    assert zoo_cli.counts(records)[:2] == (0, 0)  # skipped ones are not counted


def test_errors_are_reported_by_their_root_and_first_line():
    inner = AdaptdistError("capturing the compiled graph failed on rank 1: CaptureError: cannot capture x\nmore")
    outer = RuntimeError("backend failed")
    outer.__cause__ = inner
    assert zoo_cli.error_line(zoo_cli.root_error(outer)) == (
        "CaptureError: cannot capture x (rank 1, capturing the compiled graph)")
    assert zoo_cli._compile_stage(inner) == "capture"
    typed = CaptureError("capturing the compiled graph failed on rank 1: cannot capture x\nmore")  # (its own type)
    assert zoo_cli.error_line(typed) == "CaptureError: cannot capture x (rank 1, capturing the compiled graph)"
    rec = {}
    zoo_cli.judge(rec, {"loss": 0.0, "param": 0.5}, 1e-5, random=False, missing=[])
    assert rec["outcome"] == "differs" and "param" in rec["error"]  # wrong numbers are never "equal"
    zoo_cli.judge(rec, {"loss": 0.0, "param": 0.5}, 1e-5, random=True, missing=[])
    assert rec["outcome"] == "rng"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_mlp_under_auto_and_dp_through_both_front_ends(tmp_path, capsys):
    """4 combinations (2 plans x backend, train), each equal to eager: the table, results.json, the PNG and the
    last line."""
    out = tmp_path / "zoo"
    assert main(["zoo", "--models", "mlp", "--plans", "auto,dp", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.rstrip().splitlines()[-1] == "4 of 4 combinations equal eager"
    assert "[4/4] mlp dp train: equal" in printed.err  # progress while running
    doc = json.loads((out / "results.json").read_text())
    assert doc["equal"] == 4 and doc["combinations"] == 4
    for r in doc["records"]:
        assert r["captured"] and r["planned"] and r["ran"] and r["equal"], r
        assert r["diffs"]["loss"] <= 1e-5 and r["diffs"]["param"] <= 1e-5, r
        assert r["mesh"] and r["compile_s"] is not None and r["compile_s"] > 0
    dp = next(r for r in doc["records"] if r["plan"] == "dp" and r["front_end"] == "backend")
    assert dp["mesh"] == "dp=2" and "all_reduce" in dp["strategy"] and dp["diffs"]["grad"] <= 1e-5
    assert (out / "zoo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hugging_face_gpt2_under_dp_through_the_backend(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    [rec] = zoo_cli.sweep(["hf-gpt2"], ["dp"], ["backend"], 2, 2, 0.1, tmp_path, 300)
    assert rec["outcome"] == "equal", rec
    assert rec["mesh"] == "dp=2" and rec["diffs"]["grad"] <= 1e-5


@pytest.mark.bench
@pytest.mark.timeout(7200)
def test_full_zoo_sweep(tmp_path, capsys):
    """Every model x plan x front end: no combination gives wrong numbers silently (each is equal to eager, differs
    by design (dropout), or stops with an error naming its stage and construct)."""
    assert main(["zoo", "--out", str(tmp_path / "zoo")]) == 0
    doc = json.loads((tmp_path / "zoo" / "results.json").read_text())
    assert not [r for r in doc["records"] if r["outcome"] == "differs"]
    assert all(r["error"] for r in doc["records"] if r["outcome"] == "error")
    print(capsys.readouterr().out.splitlines()[-1])


def test_table_and_grid_of_every_outcome(tmp_path):
    from adaptdist.console import report_console

    records = [dict(model="mlp", plan=p, front_end=f, outcome=o, stage=s, error=e, captured=s != "capture",
                    planned=s not in ("capture", "plan"), ran=s is None, equal=o == "equal", strategy="dp on dp=2",
                    compile_s=0.5)
               for (p, f, o, s, e) in [("dp", "backend", "equal", None, None),
                                       ("fsdp", "backend", "error", "plan", "UnsupportedOpError: x"),
                                       ("dp", "train", "differs", None, "differs from eager"),
                                       ("fsdp", "train", "rng", None, "differs by design (rng)"),
                                       ("auto", "train", "skipped", None, "transformers is not installed")]]
    zoo_cli.write_png(records, tmp_path / "zoo.png")
    assert (tmp_path / "zoo.png").stat().st_size > 1000
    console = report_console()
    with console.capture() as cap:
        zoo_cli.print_table(records, console)
    text = cap.get()
    assert "plan: UnsupportedOpError: x" in text and "differs" in text
    assert zoo_cli.counts(records)[:2] == (1, 4)


def test_hugging_face_swin_under_a_batch_split_equals_eager_without_gathering():
    """HF Swin (issue 14: "as_strided: no rule" under dp): its pooler's as_strided is folded into reshapes at
    capture, so dp lowers it on 2 simulated ranks with no gather of the batch, equal to eager after 2 SGD steps."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    from passutil import collective_nodes, simulated_sgd
    from reference import eager_sgd

    model, batch, loss_fn = zoo.get("hf-swin").build(4)
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, 2, "dp", 0.1, 2)
    assert all(not collective_nodes(p.graph_module, "all_gather") for p in progs.values())
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, 0.1, 2)
    for (loss, grads), (want_loss, want_grads) in zip(hist, want_hist):
        assert loss == pytest.approx(want_loss, abs=1e-5)
        for f, g in want_grads.items():
            torch.testing.assert_close(grads[f], g, atol=1e-5, rtol=0, msg=f)
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=1e-5, rtol=0, msg=f)


def test_an_error_told_by_another_rank_keeps_its_type():
    """The backend raises a rank's adaptdist error on every rank as its own type (``except CaptureError`` works);
    other types stay AdaptdistError with their name in the text."""
    from adaptdist.compiler.dynamo_backend import _error_type

    assert _error_type("CaptureError: cannot capture x") == (CaptureError, "cannot capture x")
    assert _error_type("ValueError: bad") == (AdaptdistError, "ValueError: bad")
    assert _error_type("no type here") == (AdaptdistError, "no type here")
