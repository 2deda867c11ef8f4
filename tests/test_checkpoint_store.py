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


def test_a_checkpoint_begun_and_never_committed_is_named_on_resume(tmp_path):
    """New-user report: with --async-checkpoint a rank killed after step 5 resumed from step 2, though the log
    had said 'checkpoint .../step-00000004', and nothing said why step 4 was not used."""
    _write(tmp_path, 2)
    cs.prepare(tmp_path, 4)  # the asynchronous write of step 4, never committed (the ranks died first)
    (cs.temporary_dir(tmp_path, 4) / "rank0").mkdir()
    info = cs.latest_good(tmp_path)
    assert info.step == 2
    note = cs.resume_note(tmp_path, info)
    assert note.startswith("checkpoint step-00000004 was not complete (its write was interrupted before its "
                           "commit"), note
    assert note.endswith(": resuming from step-00000002 (step 2)"), note
    assert cs.unfinished_checkpoints(tmp_path) == [(4, cs.temporary_dir(tmp_path, 4))]


def test_no_resume_note_when_nothing_later_was_begun(tmp_path):
    cs.prepare(tmp_path, 2)  # an older unfinished write (left by a crash, before the newest committed one)
    _write(tmp_path, 4)
    assert cs.resume_note(tmp_path, cs.latest_good(tmp_path)) is None
    assert cs.resume_note(tmp_path / "none", None) is None


def test_an_uncommitted_first_checkpoint_says_the_run_starts_again(tmp_path):
    cs.prepare(tmp_path, 2)
    note = cs.resume_note(tmp_path, cs.latest_good(tmp_path))
    assert "checkpoint step-00000002 was not complete" in note and "starting again from step 0" in note, note


def test_the_worker_logs_why_it_resumes_from_an_older_checkpoint(tmp_path):
    from adaptdist.runtime.worker import _newest_checkpoint

    _write(tmp_path, 2)
    cs.prepare(tmp_path, 4)
    notes = []
    path, meta = _newest_checkpoint(tmp_path, notes.append)
    assert meta["step"] == 2 and path.endswith("step-00000002")
    assert len(notes) == 1 and "step-00000004 was not complete" in notes[0], notes


def test_the_progress_log_calls_only_a_committed_checkpoint_a_checkpoint():
    from adaptdist.runtime.worker import checkpoint_line

    begun = checkpoint_line(4, 8, "out/checkpoints/step-00000004", writing=True)
    assert begun == ("step 4/8: writing checkpoint out/checkpoints/step-00000004 in the background (usable once "
                     "committed, at the next checkpoint)")
    assert checkpoint_line(6, 8, "out/checkpoints/step-00000004", committed_late=True) == \
        "step 6/8: checkpoint out/checkpoints/step-00000004 committed"
    assert checkpoint_line(2, 8, "out/checkpoints/step-00000002") == "step 2/8: checkpoint out/checkpoints/step-00000002"
