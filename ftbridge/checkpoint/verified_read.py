"""Read a checkpoint's ``.pt`` files once: the bytes checked against the manifest are the bytes parsed.

Each rank reads each file it loads into memory once (bounded by the manifest's size, never following
a link), hashes those bytes and parses the same bytes (``docs/checkpoints.md``, "How it works").
Two kinds of error, which the caller treats differently:

* :class:`CorruptFileError`: missing, not a regular file, not listed, another size or SHA-256; the
  checkpoint is damaged and a resume falls back to an older one;
* :class:`ftbridge.checkpoint.safe_load.UnsafeCheckpointError`: the bytes match the manifest but need
  a type outside the allowlist; a resume stops.
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
    """The bytes of ``path``, checked against its manifest ``entry``; reads at most ``entry["bytes"] + 1`` bytes.

    Args:
        path: a file directly in a checkpoint folder.
        entry: its manifest entry, ``{"bytes": int, "sha256": 64 hex}``, or ``None`` when not listed.

    Raises:
        CorruptFileError: not listed, missing, unreadable, a link or not a regular file, another size,
            or another SHA-256.
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
        files: that folder's shape-checked manifest ``files`` (:func:`ftbridge.checkpoint.manifest.read_manifest`).

    Returns:
        ``{absolute path: loaded object}``, CPU tensors in memory of their own, for
        :class:`ftbridge.checkpoint.safe_load.SafeLoader`.

    Raises:
        CorruptFileError: a file does not match its entry.
        UnsafeCheckpointError: a file matches, but needs a type outside the allowlist.
    """
    out: Dict[str, Any] = {}
    for path in paths:
        data = read_checked(path, files.get(os.path.basename(path)))
        out[os.path.abspath(path)] = safe_load(io.BytesIO(data), "cpu", name=path)  # the very bytes just hashed
    return out
