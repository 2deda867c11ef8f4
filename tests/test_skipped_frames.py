"""A frame Dynamo skips (runs eagerly, uncompiled) never reaches the backend: on several ranks its parameters'
gradients would never be reduced, so every rank stops with an error naming the frame (never silently
unsynchronised training); on one rank eager is the single-process step and trains."""

import re

import pytest
import torch

import adaptdist
from adaptdist.models.zoo import TopKMoE
from adaptdist.runtime.launch import launch_local
from skipped_frame_workers import skipped_frame_worker


@pytest.mark.timeout(300)
@pytest.mark.parametrize("by_name", [False, True], ids=["backend-object", "backend-by-name"])
def test_a_skipped_frame_stops_every_rank_with_its_name(by_name):
    errors = launch_local(skipped_frame_worker, (by_name,), 2)
    for r in range(2):
        assert re.search(r"(?s)CaptureError: torch.compile skipped forward \(.*zoo.py line \d+\).*never be reduced"
                         r".*dense dispatch", errors[r]), (r, errors[r])


def test_one_rank_trains_a_skipped_frame_eagerly():
    torch.manual_seed(0)
    model = TopKMoE()
    x = torch.randn(2, 3, 8)
    want = model(x).sum()
    got = torch.compile(model, backend=adaptdist.backend(plan="dp"))(x).sum()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
