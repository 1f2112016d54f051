"""The CKKS key files of a certificate folder: both written, or neither."""

from __future__ import annotations

from typing import Any

import pytest

import privacy.ckks.keys as key_files


def test_writing_ckks_keys_replaces_both_files_or_neither(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a certificate folder with its CKKS pair
    secret_path, public_path = key_files.write_ckks_keys(tmp_path)
    before = secret_path.read_bytes(), public_path.read_bytes()

    def fail(secret: bytes) -> bytes:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(key_files, "public_context", fail)
    # Execute: an overwrite that fails after the new secret context was made
    with pytest.raises(OSError, match="No space left"):
        key_files.write_ckks_keys(tmp_path, overwrite=True)
    # Assert: the old pair is intact (a new secret beside the old public context would not
    # match it), and no temporary file is left over
    assert (secret_path.read_bytes(), public_path.read_bytes()) == before
    assert sorted(p.name for p in secret_path.parent.iterdir()) == sorted(
        [secret_path.name, public_path.name]
    )
    monkeypatch.undo()
    key_files.write_ckks_keys(tmp_path, overwrite=True)
    assert secret_path.read_bytes() != before[0]  # a successful overwrite does replace it
    key_files.load_public_context(tmp_path)
