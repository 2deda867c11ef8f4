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
