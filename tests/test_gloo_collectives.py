"""The functional collectives adaptdist emits, on gloo, with non-contiguous and zero-element inputs."""

import pytest
import torch

from adaptdist.runtime.launch import launch_local
from dist_workers import collective_edge_cases_worker

pytestmark = pytest.mark.slow  # starts ranks (processes)


def test_non_contiguous_and_empty_tensors_on_gloo():
    world = 2
    res = launch_local(collective_edge_cases_worker, (), world)
    nc = [(torch.arange(12.0).view(3, 4) + 100 * r).t() for r in range(world)]
    for r in range(world):
        out = res[r]
        torch.testing.assert_close(out["all_reduce_nc"], sum(nc))
        torch.testing.assert_close(out["all_gather_nc"], torch.cat(nc))
        # each rank's input is a non-contiguous [world, 4] view; rank r keeps row r of the sum
        full = sum(torch.arange(4.0 * world).view(world, 4) + q for q in range(world))
        torch.testing.assert_close(out["reduce_scatter_nc"], full[r:r + 1])
        assert out["all_reduce_empty"].shape == (0, 3)
        assert out["all_gather_empty"].shape == (0, 3)
