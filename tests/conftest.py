import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
"""Measured seconds of each test file's tests (setup + call + teardown, module fixtures included) per CI stage
(its -m expression): the order files are handed to pytest-xdist workers (see pytest_collection_modifyitems).
Refresh a stage's figures with ``--record-seconds tests/file_seconds.json`` on a CI-like run of it."""
UNMEASURED_S_PER_TEST = 10.0  # a file FILE_SECONDS does not name: by its number of tests, as xdist would order it


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/goldens/* from the current code generation (review the diff)")
    parser.addoption("--record-seconds", metavar="FILE", default=None,
                     help="write each file's measured seconds into FILE under this run's -m expression "
                          "(tests/file_seconds.json orders the files for pytest-xdist workers)")


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker runs torch on one intra-op thread: N workers sharing the
    machine's cores would otherwise each start a thread per core and oversubscribe them. Files go to the
    workers in the order pytest_collection_modifyitems gives them (longest first), not re-sorted by xdist by
    their number of tests."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    if hasattr(config.option, "loadscopereorder") and _stage_seconds(config.getoption("markexpr") or ""):
        config.option.loadscopereorder = False
    path = config.getoption("--record-seconds")
    if path is not None and not hasattr(config, "workerinput"):  # the controller, under xdist
        config.pluginmanager.register(_SecondsRecorder(Path(path), config.getoption("markexpr") or ""))


def _stage_seconds(markexpr: str) -> dict[str, float]:
    """{file: expected seconds} of this -m expression's stage in FILE_SECONDS (every stage summed without -m);
    empty for a stage not measured, or when the file is missing or unreadable (then xdist orders files by their
    number of tests)."""
    try:
        stages = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return {}
    if markexpr in stages or markexpr:
        return stages.get(markexpr, {})
    total: dict[str, float] = {}
    for files in stages.values():
        for path, s in files.items():
            total[path] = total.get(path, 0.0) + s
    return total


def _sort_files_longest_first(config, items) -> None:
    """Files longest first (FILE_SECONDS), each file's tests in their own order: pytest-xdist hands a worker the
    next file when it is nearly done with its own, so a long file left for last would run alone at the end while
    the other worker idles."""
    seconds = _stage_seconds(config.getoption("markexpr") or "")
    if not seconds:
        return
    counts: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        counts[path] = counts.get(path, 0) + 1
    cost = {path: seconds.get(path, UNMEASURED_S_PER_TEST * n) for path, n in counts.items()}
    rank = {path: i for i, path in enumerate(sorted(counts, key=lambda p: -cost[p]))}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: in-file order kept


@pytest.hookimpl(trylast=True)  # after -m/-k deselected what this run leaves out
def pytest_collection_modifyitems(config, items):
    """Files longest first (see _sort_files_longest_first); ``bench`` tests (sweeps, stress, faults: outside CI)
    run only when ``-m`` names them."""
    _sort_files_longest_first(config, items)
    if "bench" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="bench: run outside CI with -m bench")
    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(skip)


class _SecondsRecorder:
    """--record-seconds FILE: each file's tests' phases summed, written under the run's -m expression (the other
    stages' figures kept)."""

    def __init__(self, path: Path, markexpr: str):
        self.path, self.markexpr, self.seconds = path, markexpr, {}

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if not self.seconds:
            return
        try:
            stages = json.loads(self.path.read_text())
        except (OSError, ValueError):
            stages = {}
        stages[self.markexpr] = {p: round(s, 1) for p, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.path.write_text(json.dumps(stages, indent=1) + "\n")
