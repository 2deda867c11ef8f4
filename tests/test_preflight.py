"""Pre-launch memory check: a job that cannot fit this host fails in seconds with the figures."""

import pytest

from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import UsageError
from adaptdist.runtime.preflight import RANK_OVERHEAD_BYTES, available_memory_bytes, check_host_memory
from models import tiny_gpt


def test_refuses_ranks_that_do_not_fit_and_names_the_figures():
    model, batch, loss_fn = tiny_gpt(4, 8)
    progs = compile_model(model, batch, loss_fn, 2)
    peak = check_host_memory(progs, "adamw", 2, available_bytes=2**40)
    assert 0 < peak < 64 * 2**20
    with pytest.raises(UsageError, match=r"x 2 local ranks.*GiB available; lower --batch-size or --seq-len"):
        check_host_memory(progs, "adamw", 2, available_bytes=2 * RANK_OVERHEAD_BYTES + peak)


def test_reads_this_hosts_available_memory():
    avail = available_memory_bytes()
    assert avail is None or avail > 2**28


class _Launched(Exception):
    """Raised by the fake launcher: the run got past the preflight."""


def _train_with_tiny_memory(monkeypatch, *extra):
    import adaptdist.runtime.launch as launch
    import adaptdist.runtime.preflight as preflight
    from adaptdist.cli import main

    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 2**20)  # a host with 1 MiB free

    def fake_launch(*args, **kwargs):
        raise _Launched()

    monkeypatch.setattr(launch, "launch_local", fake_launch)
    return lambda tmp_path: main(["train", "--nproc", "2", "--batch-size", "4", "--seq-len", "8", "--plan", "dp",
                                  "--steps", "1", "--out", str(tmp_path / "out"), *extra])


def test_train_refuses_with_the_figures_and_the_flag_lets_it_launch(monkeypatch, tmp_path, capsys, caplog):
    run = _train_with_tiny_memory(monkeypatch)
    assert run(tmp_path) == 2  # refused before any rank starts
    err = " ".join(capsys.readouterr().err.split())
    assert "GiB per rank x 2 local ranks" in err and "0.0 GiB available" in err and "--skip-memory-check" in err
    run = _train_with_tiny_memory(monkeypatch, "--skip-memory-check")
    with pytest.raises(_Launched), caplog.at_level("WARNING", logger="adaptdist.runtime"):
        run(tmp_path)
    assert "running anyway (--skip-memory-check)" in caplog.text and "GiB available" in caplog.text


def test_skip_memory_check_is_documented_in_train_help(capsys):
    from adaptdist.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--skip-memory-check" in capsys.readouterr().out


def test_check_host_memory_only_warns_when_not_enforced(caplog):
    model, batch, loss_fn = tiny_gpt(4, 8)
    progs = compile_model(model, batch, loss_fn, 2)
    with caplog.at_level("WARNING", logger="adaptdist.runtime"):
        peak = check_host_memory(progs, "adamw", 2, available_bytes=2**20, enforce=False)
    assert 0 < peak < 64 * 2**20 and "GiB per rank x 2 local ranks" in caplog.text
