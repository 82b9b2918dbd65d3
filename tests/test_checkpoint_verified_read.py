"""ftbridge.checkpoint.verified_read: the bytes parsed are the bytes checked, or a CorruptFileError."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from ftbridge.checkpoint.safe_load import UnsafeCheckpointError
from ftbridge.checkpoint.verified_read import CorruptFileError, load_checked, read_checked


def _entry(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_matching_file_is_parsed_from_the_bytes_read(tmp_path):
    path = str(tmp_path / "a.pt")
    torch.save({"w": torch.arange(4.0)}, path)
    data = open(path, "rb").read()
    got = load_checked([path], {"a.pt": _entry(data)})
    torch.testing.assert_close(got[os.path.abspath(path)]["w"], torch.arange(4.0))


@pytest.mark.parametrize("damage", ["unlisted", "missing", "grown", "shrunk", "altered", "link", "fifo"])
def test_every_mismatch_is_a_corrupt_file_naming_it(tmp_path, damage):
    path = tmp_path / "a.pt"
    torch.save({"w": torch.ones(8)}, str(path))
    data = path.read_bytes()
    files = {"a.pt": _entry(data)}
    if damage == "unlisted":
        files = {}
    elif damage == "missing":
        path.unlink()
    elif damage == "grown":
        path.write_bytes(data + b"x")
    elif damage == "shrunk":
        path.write_bytes(data[:-1])
    elif damage == "altered":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "link":
        (tmp_path / "real.pt").write_bytes(data)
        path.unlink()
        path.symlink_to(tmp_path / "real.pt")
    else:
        path.unlink()
        os.mkfifo(path)  # never opened for a blocking read
    with pytest.raises(CorruptFileError, match="a.pt"):
        load_checked([str(path)], files)


def test_a_matching_file_that_needs_a_foreign_type_is_unsafe_not_corrupt(tmp_path):
    path = str(tmp_path / "a.pt")
    torch.save({"f": os.getcwd}, path)  # a function reference: refused by weights_only
    data = open(path, "rb").read()
    with pytest.raises(UnsafeCheckpointError, match="a.pt"):
        load_checked([path], {"a.pt": _entry(data)})


def test_a_file_larger_than_its_entry_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "big.pt"
    path.write_bytes(b"\0" * 10_000)
    with pytest.raises(CorruptFileError, match="larger than 10 bytes"):
        read_checked(str(path), {"bytes": 10, "sha256": "0" * 64})
