"""Atomic writes (gyre.common.files): a reader sees the old content or the whole new one, never half."""

import os
import stat

import pytest

from gyre.common.files import atomic_path, write_atomic, write_private_file


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_a_folder_appears_whole_and_private_files_are_owner_only(tmp_path):
    with atomic_path(tmp_path / "cache") as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("1")
        assert not (tmp_path / "cache").exists()
    assert (tmp_path / "cache" / "a").read_text() == "1"
    write_private_file(tmp_path / "key", b"secret", fsync=True)
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600 and (tmp_path / "key").read_bytes() == b"secret"
