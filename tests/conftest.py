import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/goldens/* from the current code generation (review the diff)")


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker runs torch on one intra-op thread: N workers sharing the
    machine's cores would otherwise each start a thread per core and oversubscribe them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``bench`` tests (sweeps, stress, faults: outside CI) run only when ``-m`` names them."""
    import pytest

    if "bench" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="bench: run outside CI with -m bench")
    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(skip)
