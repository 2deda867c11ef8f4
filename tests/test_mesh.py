"""The N-D device mesh: row-major coordinates, groups per axis, parsing and its errors."""

import pytest

from adaptdist.errors import UsageError
from adaptdist.mesh import Mesh


def test_row_major_coordinates_and_groups_like_torch_device_mesh():
    m = Mesh.parse("dp=2,tp=3")
    assert m.world_size == 6 and m.names == ("dp", "tp") and m.sizes == (2, 3)
    assert [m.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(m.rank(m.coords(r)) == r for r in range(6))
    assert m.group("tp", 4) == (3, 4, 5) and m.group("dp", 4) == (1, 4)
    assert m.groups("dp") == [(0, 3), (1, 4), (2, 5)]
    assert m.groups("tp") == [(0, 1, 2), (3, 4, 5)]
    assert Mesh.group_name("tp") == "adaptdist:tp" and str(m) == "dp=2,tp=3"


def test_three_axes():
    m = Mesh.parse("pp=2,dp=2,tp=2")
    assert m.coords(5) == (1, 0, 1) and m.group("dp", 5) == (5, 7) and m.group("tp", 5) == (4, 5) and m.group("pp", 5) == (1, 5)


@pytest.mark.parametrize("text,expect", [
    ("dp2", "not AXIS=SIZE"), ("dp=two", "not AXIS=SIZE"), ("dp=2,dp=2", "repeat a name"),
    ("dp=0", "positive"), ("1x=2", "identifier"),
])
def test_bad_mesh_text_is_a_clear_error(text, expect):
    with pytest.raises(UsageError, match=expect):
        Mesh.parse(text)


def test_unknown_axis_names_the_axes():
    with pytest.raises(UsageError, match=r"no axis 'pp'; its axes are \['dp', 'tp'\]"):
        Mesh.parse("dp=2,tp=2").group("pp", 0)
