"""script_runner's bounded init_process_group defaults, and ``adaptdist launch`` (bounded timeout, restarts)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from adaptdist.cli.main import main
from adaptdist.runtime.script_runner import init_defaults

from launch_workers import listening_sockets


def _recorder(calls):
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None, _ranks=None):
        calls.append(dict(backend=backend, init_method=init_method, timeout=timeout, world_size=world_size,
                          rank=rank, store=store))
    return init_process_group


def test_init_defaults_bound_the_timeout_and_keep_explicit_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", _recorder(calls))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with init_defaults(collective_s=7):
        dist.init_process_group("gloo")
        dist.init_process_group("gloo", timeout=timedelta(seconds=99))
    dist.init_process_group("gloo")  # restored on exit
    assert calls[0]["timeout"] == timedelta(seconds=7) and calls[0]["store"] is None
    assert calls[1]["timeout"] == timedelta(seconds=99)
    assert calls[2]["timeout"] is None


def test_init_defaults_make_rank_0_store_on_loopback(monkeypatch):
    from adaptdist.runtime.launch import free_loopback_port

    calls = []
    monkeypatch.setattr(dist, "init_process_group", _recorder(calls))
    port = free_loopback_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with init_defaults(collective_s=7):
        dist.init_process_group("gloo")
    call = calls[0]
    assert call["rank"] == 0 and call["world_size"] == 2 and call["store"] is not None
    mine = [(addr, p) for _, addr, p in listening_sockets({os.getpid()}) if p == port]
    assert mine == [("127.0.0.1", port)], mine


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_bounds_the_wait_for_a_rank_that_left(capsys, tmp_path):
    script = tmp_path / "leaves.py"
    script.write_text("import os, sys\nimport torch, torch.distributed as dist\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(0)  # leaves before joining the group\n"
                      "dist.init_process_group('gloo')  # no timeout= here: torch's default is 30 minutes\n"
                      "dist.all_reduce(torch.ones(1))\n")
    t0 = time.monotonic()
    rc = main(["launch", "--nproc", "2", "--collective-timeout-s", "3", str(script)])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and "failed on rank 0" in err, err
    assert took < 3 + 25, took  # the 3 s timeout, plus starting two ranks on a loaded machine


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_max_restarts_restarts_a_failed_rank(capsys, tmp_path):
    script = tmp_path / "flaky.py"
    marker = tmp_path / "attempts.txt"
    script.write_text("import os, sys\nimport torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      f"open({str(marker)!r}, 'a').write(os.environ['TORCHELASTIC_RESTART_COUNT'] + '\\n')\n"
                      "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
                      "    os._exit(1)\n"
                      "dist.all_reduce(torch.ones(1))\ndist.destroy_process_group()\n")
    rc = main(["launch", "--nproc", "2", "--max-restarts", "1", "--timeout-s", "10", str(script)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert sorted(marker.read_text().split()) == ["0", "0", "1", "1"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_stores_listen_on_loopback_only(capsys, tmp_path, monkeypatch):
    from pathlib import Path

    tests = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    script = tmp_path / "sockets.py"
    out = tmp_path / "sockets.txt"
    script.write_text("import os\nimport torch.distributed as dist\n"
                      "from launch_workers import descendants, listening_sockets\n"
                      "dist.init_process_group('gloo')\ndist.barrier()\n"
                      "if dist.get_rank() == 0:\n"
                      "    launcher = os.getppid()\n"
                      "    rows = listening_sockets({launcher} | descendants(launcher))\n"
                      f"    open({str(out)!r}, 'w').write(repr(rows))\n"
                      "dist.barrier()\ndist.destroy_process_group()\n")
    rc = main(["launch", "--nproc", "2", str(script)])
    assert rc == 0, capsys.readouterr().err
    rows = eval(out.read_text())
    assert any(pid == os.getpid() for pid, _, _ in rows), rows  # the rendezvous store, in the launcher
    assert len(rows) >= 3, rows  # and the workers' store and gloo's sockets
    assert not [r for r in rows if r[1] not in ("127.0.0.1", "::1")], rows
