"""Graceful stop: a SIGTERM to one worker or to the launcher stops every rank after the same step, exit 143,
and the launcher prints one line, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adaptdist.errors import RunInterruptedError
from adaptdist.runtime.launch import launch_local
from adaptdist.runtime.stop import StopRequest, interrupted_exit_code, interrupted_message, stop_exit_code

from launch_workers import stop_worker

TESTS = Path(__file__).parent
REPO = TESTS.parent


def test_stop_request_notes_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.requested is None and stop.agreed(0) is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # the first signal wins
        time.sleep(0.01)
        assert stop.agreed(3) == signal.SIGTERM  # one process: its own signal
    assert signal.getsignal(signal.SIGTERM) is before


def test_every_skips_agreement_steps():
    stop = StopRequest(every=4)
    stop.request(signal.SIGINT)
    assert stop.agreed(1) is None and stop.agreed(4) == signal.SIGINT


def test_interrupted_exit_codes():
    from torch.distributed.elastic.multiprocessing.api import SignalException

    assert stop_exit_code(signal.SIGTERM) == 143 and stop_exit_code(signal.SIGINT) == 130
    assert interrupted_exit_code(SignalException("x", signal.SIGTERM)) == 143
    assert interrupted_exit_code(KeyboardInterrupt()) == 130
    assert interrupted_exit_code(RunInterruptedError("m", signal.SIGINT)) == 130
    assert interrupted_exit_code(ValueError()) is None
    assert interrupted_message(SignalException("x", signal.SIGTERM)) == "interrupted by SIGTERM"


def _stopped(out: Path) -> dict[int, tuple[int, int]]:
    res = {}
    for p in out.glob("stopped-*"):
        step, sig = p.read_text().split()
        res[int(p.name.split("-")[1])] = (int(step), int(sig))
    return res


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    with pytest.raises(RunInterruptedError) as info:
        launch_local(stop_worker, (str(tmp_path), 50, 0.05, 1, 3), 3)
    assert info.value.exit_code == 143
    assert _stopped(tmp_path) == {0: (3, 15), 1: (3, 15), 2: (3, 15)}


LAUNCHER = textwrap.dedent("""
    import sys
    from adaptdist.runtime.launch import launch_local
    from adaptdist.runtime.stop import interrupted_exit_code, interrupted_message
    from launch_workers import stop_worker
    try:
        launch_local(stop_worker, (sys.argv[1], 10000, 0.05), 2)
    except BaseException as e:
        code = interrupted_exit_code(e)
        if code is None:
            raise
        print("adaptdist:", interrupted_message(e), file=sys.stderr)
        import time
        from adaptdist.runtime.timeouts import Timeouts
        # a launcher that goes on a while (train writes its files): past one rendezvous keep-alive beat
        time.sleep(Timeouts().keep_alive_interval_s + 0.5)
        sys.exit(code)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_rank_and_prints_one_line(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"progress-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.3)
        t_sig = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the whole foreground group
        else:
            proc.send_signal(sig)  # a preemption notice to the launcher alone
        out, err = proc.communicate(timeout=60)
        stop_s = time.monotonic() - t_sig
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert "Traceback" not in err, err
    # torch leaves its rendezvous heartbeat running after a signal; beating against the launcher's closed
    # store it logged "Failed to recv" with a C++ stack after the launcher's last line
    assert "TCPStore" not in err and "c10d" not in err, err
    assert f"adaptdist: interrupted by {signal.Signals(sig).name}" in err
    stopped = _stopped(tmp_path)
    assert sorted(stopped) == [0, 1] and len({s for s, _ in stopped.values()}) == 1, stopped
    assert {g for _, g in stopped.values()} == {int(sig)}
    assert stop_s < 10, stop_s
