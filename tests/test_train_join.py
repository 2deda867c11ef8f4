"""`adaptdist train --join OUT` starts its agent in the environment of the job's own agents (found by
benchmarks/bench_faults.py: without it the joiner's worker looked for torch's agent store and no rank met the
others in init_process_group)."""

import json
import subprocess

from adaptdist.cli.train import ELASTIC_FILE, cmd_join
from adaptdist.console import report_console
from adaptdist.runtime.launch import LOCAL_RUN_ENV


def test_join_starts_the_agent_with_the_local_run_environment(tmp_path, monkeypatch):
    (tmp_path / ELASTIC_FILE).write_text(json.dumps({"command": ["agent", "--args"], "launcher_pid": 1,
                                                     "min": 2, "max": 4}))
    for k in LOCAL_RUN_ENV:
        monkeypatch.delenv(k, raising=False)
    seen = {}

    def call(cmd, env):
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    assert cmd_join(tmp_path, report_console(stderr=True)) == 0
    assert seen["cmd"] == ["agent", "--args"]
    for k, v in LOCAL_RUN_ENV.items():
        assert seen["env"][k] == v, k
