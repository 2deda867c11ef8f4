"""Checkpoint directories: atomic commit, manifest checks, newest-good-first, keep K, another model refused."""

import json

import pytest

from adaptdist.errors import CheckpointError
from adaptdist.runtime import checkpoint_store as cs


def _write(root, step, payload=b"x" * 100, keep=None):
    tmp = cs.prepare(root, step)
    (tmp / "rank0").mkdir()
    (tmp / "rank0" / "data.bin").write_bytes(payload)
    return cs.commit(tmp, {"step": step, "model": "m", "state_shapes": {"w": [2, 3]}}, keep=keep)


def test_commit_renames_and_verifies(tmp_path):
    final = _write(tmp_path, 7)
    assert final == cs.step_dir(tmp_path, 7) and final.is_dir()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    meta = cs.verify(final)
    assert meta["step"] == 7
    manifest = json.loads((final / cs.MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"meta.json", "rank0/data.bin"}


def test_partial_and_temporary_directories_are_never_used(tmp_path):
    _write(tmp_path, 1)
    cs.prepare(tmp_path, 2)  # a writer that crashed before commit
    (tmp_path / "step-00000003").mkdir()  # a directory without manifest
    logs = []
    info = cs.latest_good(tmp_path, logs.append)
    assert info.step == 1
    assert len(logs) == 1 and "step-00000003" in logs[0] and "partial" in logs[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "extra", "delete"])
def test_corrupt_checkpoint_falls_back_to_previous_one_and_says_why(tmp_path, damage):
    _write(tmp_path, 1)
    bad = _write(tmp_path, 2)
    f = bad / "rank0" / "data.bin"
    if damage == "flip":
        b = bytearray(f.read_bytes()); b[10] ^= 1; f.write_bytes(bytes(b))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:50])
    elif damage == "extra":
        (bad / "rank0" / "other.bin").write_bytes(b"y")
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match="step-00000002"):
        cs.verify(bad)
    logs = []
    info = cs.latest_good(tmp_path, logs.append)
    assert info.step == 1 and "step-00000002" in logs[0]
    want = {"flip": "sha256", "truncate": "bytes", "extra": "does not list", "delete": "lacks"}[damage]
    assert want in logs[0]


def test_keep_prunes_oldest_and_same_step_is_replaced(tmp_path):
    for s in (1, 2, 3, 4):
        _write(tmp_path, s, keep=2)
    assert [s for s, _ in cs.list_checkpoints(tmp_path)] == [3, 4]
    _write(tmp_path, 4, payload=b"z" * 10, keep=2)
    assert (cs.step_dir(tmp_path, 4) / "rank0" / "data.bin").read_bytes() == b"z" * 10
    assert cs.latest_good(tmp_path).step == 4
    assert cs.latest_good(tmp_path / "none") is None


def test_another_model_is_refused_naming_both(tmp_path):
    final = _write(tmp_path, 1)
    meta = cs.verify(final)
    cs.check_same_model(meta, final, "m", {"w": [2, 3]})
    with pytest.raises(CheckpointError, match=r"'m', not 'other'.*w is \[2, 3\] there but \[4, 3\]"):
        cs.check_same_model(meta, final, "other", {"w": [4, 3]})
    with pytest.raises(CheckpointError, match="lacks"):
        cs.check_same_model(meta, final, "other", {"w": [2, 3], "b": [3]})
