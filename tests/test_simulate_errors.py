"""The one-process rank simulator fails with a typed adaptdist error."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from adaptdist.errors import AdaptdistError, SimulationError
from adaptdist.mesh import Mesh
from adaptdist.runtime.simulate import SimulationError as FromSimulate
from adaptdist.runtime.simulate import simulate_ranks


def test_simulation_error_is_an_adaptdist_error():
    assert FromSimulate is SimulationError and issubclass(SimulationError, AdaptdistError)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(SimulationError, match="mesh dp=2 has 2 ranks but 1 programs"):
        simulate_ranks([gm], [[torch.ones(2)]], Mesh.parse("dp=2"))
