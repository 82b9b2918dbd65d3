"""Read a checkpoint's ``.pt`` files once: the bytes checked against the manifest are the bytes parsed.

Reads are bounded by the manifest's size and follow no link. :class:`CorruptFileError` (damaged: a
resume tries an older checkpoint) is distinct from
:class:`~ftbridge.checkpoint.safe_load.UnsafeCheckpointError` (matches the manifest but needs a type
outside the allowlist: a resume stops).
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
    """The bytes of ``path`` checked against its manifest ``entry`` (``{"bytes", "sha256"}`` or ``None``).

    Reads at most ``entry["bytes"] + 1`` bytes. Raises :class:`CorruptFileError` if not listed, missing,
    unreadable, a link or not a regular file, or of another size or SHA-256.
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
    """``{absolute path: object}`` of ``paths`` (in one checkpoint folder), each read, checked against the
    manifest ``files`` and parsed once, CPU tensors in memory of their own.

    Raises :class:`CorruptFileError` or :class:`~ftbridge.checkpoint.safe_load.UnsafeCheckpointError`.
    """
    out: Dict[str, Any] = {}
    for path in paths:
        data = read_checked(path, files.get(os.path.basename(path)))
        out[os.path.abspath(path)] = safe_load(io.BytesIO(data), "cpu", name=path)  # the very bytes just hashed
    return out
