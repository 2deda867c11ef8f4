"""runtime/checkpoint.gather_full: the whole tensor of a DTensor sharded on two mesh axes, gathered one axis at a
time, without DTensor's warning about "2 sequential all_gather operations ... may give inconsistent results
between ranks" (which its full_tensor() logs on a 2-D mesh: a user saw it on rank 0 of every --mesh dp=2,tp=2 run
with a YAML plan). One process on torch's fake backend (shapes and placements; tests/test_checkpoint.py checks
the values on gloo)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from adaptdist import _torch_compat as compat
from adaptdist.runtime.checkpoint import gather_full


@pytest.fixture
def mesh_2x2():
    compat.fake_process_group(0, 4)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_two_axis_shard_gathers_without_the_sequential_all_gather_warning(mesh_2x2, capfd, caplog):
    caplog.set_level(logging.WARNING)  # torch's DTensor logger (a terminal shows it on stderr)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    cases = [([Shard(0), Shard(0)], (13, 4)), ([Shard(0), Shard(1)], (6, 4)), ([Replicate(), Shard(0)], (5, 3))]
    for placements, shape in cases:
        # this rank's (rank 0) shard shape: torch.chunk over dp, then over tp
        rows = torch.empty(shape)
        for p in placements:
            if isinstance(p, Shard):
                rows = rows.chunk(2, dim=p.dim)[0]
        local = torch.randn(rows.shape)
        t = DTensor.from_local(local, mesh_2x2, placements, run_check=False, shape=torch.Size(shape),
                               stride=torch.empty(shape).stride())
        full = gather_full(t)
        assert not isinstance(full, DTensor) and tuple(full.shape) == shape, (placements, full.shape)
    err = capfd.readouterr().err + caplog.text
    assert "sequential all_gather" not in err, err
    assert gather_full(torch.ones(2)).equal(torch.ones(2))  # a plain (replicated) tensor passes through
