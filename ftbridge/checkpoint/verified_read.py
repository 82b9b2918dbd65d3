"""Read a checkpoint's ``.pt`` files once: the bytes checked against the manifest are the bytes parsed.

A resume used to hash every file on group rank 0 (choosing the checkpoint)
and then parse the files again from disk on every rank: the bytes loaded
were not necessarily the bytes hashed (a file replaced in between was parsed
unchecked, though still with ``weights_only``), and group rank 0 hashed
every rank's shard, a cost that grows with the group size.

Here each rank reads each file it loads into memory once (bounded by the
size the manifest gives, never following a link), hashes those bytes, and
parses the same bytes, once they matched, with
:func:`ftbridge.checkpoint.safe_load.safe_load`.

Errors come in two kinds, because the caller treats them differently
(:func:`ftbridge.checkpoint.group_io.load_group_checkpoint`):

* :class:`CorruptFileError`: the file is missing, not a regular file, not
  listed, of another size, or its SHA-256 differs. The checkpoint is damaged;
  a resume falls back to an older one, as when group rank 0 finds a damaged
  file while choosing.
* :class:`ftbridge.checkpoint.safe_load.UnsafeCheckpointError`: the bytes are
  the ones the manifest lists, but they need a type outside the allowlist (or
  are no torch file). A resume stops: the manifest was written for them.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Dict, List

from ftbridge.checkpoint import manifest as mf
from ftbridge.checkpoint.safe_load import safe_load


class CorruptFileError(ValueError):
    """A checkpoint file does not match its manifest entry (missing, resized, altered, or unlisted)."""


def read_checked(path: str, entry: Any) -> bytes:
    """The bytes of ``path``, checked against its manifest ``entry``.

    Args:
        path: a file directly in a checkpoint folder.
        entry: its manifest entry, ``{"bytes": int, "sha256": 64 hex}``, or
            ``None`` when the manifest does not list it.

    Returns:
        The file's bytes (``entry["bytes"]`` of them).

    Raises:
        CorruptFileError: not listed, missing, unreadable, a link or not a
            regular file, another size, or another SHA-256. At most
            ``entry["bytes"] + 1`` bytes are read.
    """
    if entry is None:
        raise CorruptFileError(f"{path}: not in the manifest (added, or its entry removed)")
    try:
        data = mf.read_bounded(path, entry["bytes"])
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{path}: unreadable or not the manifest's {entry['bytes']} bytes ({e})") from None
    if len(data) != entry["bytes"]:
        raise CorruptFileError(f"{path}: {len(data)} bytes, manifest says {entry['bytes']} (truncated or altered)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptFileError(f"{path}: SHA-256 differs from the manifest (altered)")
    return data


def load_checked(paths: List[str], files: Dict[str, Any]) -> Dict[str, Any]:
    """Read, check and parse each of ``paths`` once.

    Args:
        paths: ``.pt`` files directly in one checkpoint folder.
        files: that folder's manifest ``files`` (``{name: {"bytes", "sha256"}}``),
            read and shape-checked (:func:`ftbridge.checkpoint.manifest.read_manifest`).

    Returns:
        ``{absolute path: loaded object}``, CPU tensors in memory of their own
        (nothing maps the files), as :class:`ftbridge.checkpoint.safe_load.SafeLoader`
        takes them.

    Raises:
        CorruptFileError: a file does not match its entry (see :func:`read_checked`).
        UnsafeCheckpointError: a file matches, but needs a type outside the allowlist.
    """
    out: Dict[str, Any] = {}
    for path in paths:
        data = read_checked(path, files.get(os.path.basename(path)))
        out[os.path.abspath(path)] = safe_load(io.BytesIO(data), "cpu", name=path)  # the very bytes just hashed
    return out
