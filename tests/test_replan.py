"""compiler/replan.py: programs for another world size, planned once and cached by the graph's and the cluster
topology's fingerprints; an entry made for another cluster or graph is never reused."""

import json
import textwrap

import pytest

from adaptdist.compiler.replan import CACHE_KEY_FILE, ProgramSource
from adaptdist.errors import UsageError
from adaptdist.program import load_program


@pytest.fixture
def source(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        def factory(batch_size, seq_len):
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            g = torch.Generator().manual_seed(1)
            return model, (torch.randn(batch_size, 6, generator=g), torch.randint(0, 3, (batch_size,), generator=g)), \\
                F.cross_entropy
    """))
    return ProgramSource(model=f"{f}:factory", batch_size=6, seq_len=1, seed=0, plan="fsdp", mesh=None,
                         optimizer="sgd", cache_dir=str(tmp_path / "cache"), base_world_size=2,
                         base_program_dir=str(tmp_path / "base"))


def test_the_launch_world_size_uses_the_programs_compiled_before_launch(source):
    assert source.program_dir(2, 0, lambda p: p) == source.base_program_dir


def test_another_world_size_is_planned_once_then_reused_and_the_reuse_logged(source):
    said = []
    d = source.program_dir(3, 0, lambda p: p, said.append)
    assert load_program(d, 2, world_size=3).world_size == 3
    assert "planned 'fsdp'" in said[0]
    assert source.program_dir(3, 0, lambda p: p, said.append) == d
    assert said[1].startswith("reusing the programs planned for this graph")


def test_an_entry_of_another_cluster_is_not_reused(source):
    said = []
    d = source.program_dir(3, 0, lambda p: p, said.append)
    key_file = __import__("pathlib").Path(d) / CACHE_KEY_FILE
    key = json.loads(key_file.read_text())
    key["cluster"] = "0123456789abcdef"  # as if planned for another topology
    key_file.write_text(json.dumps(key))
    assert source.program_dir(3, 0, lambda p: p, said.append) == d
    assert said[1].startswith("planned"), said  # planned again, not reused
    assert json.loads(key_file.read_text())["cluster"] != "0123456789abcdef"


def test_another_host_compiles_the_same_programs_and_its_other_ranks_wait(source):
    """Rank 0 publishes its path; on a host that does not see rank 0's files the local rank 0 plans the same
    programs under the same path (planning is deterministic), and a rank that waits in vain says so."""
    import shutil
    from dataclasses import replace

    from adaptdist.errors import RuntimeLaunchError

    d = source.program_dir(3, 0, lambda p: p)
    shutil.rmtree(d)  # as if on another machine
    assert source.program_dir(3, 1, lambda p: d, local_rank=0) == d
    assert load_program(d, 1, world_size=3).world_size == 3
    shutil.rmtree(d)
    with pytest.raises(RuntimeLaunchError, match="did not appear within 0 s"):
        replace(source, compile_wait_s=0.3).program_dir(3, 2, lambda p: d, local_rank=1)


def test_a_fixed_mesh_cannot_be_elastic(source):
    from dataclasses import replace

    with pytest.raises(UsageError, match="--mesh dp=2"):
        replace(source, mesh="dp=2").check_elastic()
    with pytest.raises(UsageError, match="saved plan"):
        replace(source, plan="plan.json").check_elastic()
