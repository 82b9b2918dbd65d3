"""Checkpoint manifest and atomic publication.

A checkpoint is published in four moves, so that a reader never sees half of
one and a writer killed at any point leaves the previous checkpoint as the
latest:

1. every group rank writes its files into ``ROOT/.tmp-<tag>-q<quorum>/<tag>/``
   and fsyncs them;
2. group rank 0 writes ``manifest.json`` (every file's size and SHA-256) and
   fsyncs the folder;
3. ``rename(ROOT/.tmp-…/<tag>, ROOT/<tag>)`` (atomic on POSIX; it fails when
   ``ROOT/<tag>`` exists, so a step is published at most once);
4. ``ROOT/latest`` (DeepSpeed's own pointer file: the tag as text) is
   replaced atomically through a temporary file and ``os.replace``.

:func:`verify` re-reads every file against the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional

MANIFEST = "manifest.json"
LATEST = "latest"
_CHUNK = 1 << 20


def sha256_file(path: str) -> str:
    """SHA-256 of a file's bytes, as 64 hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str) -> None:
    """fsync a file or a folder (folder: makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_manifest(ckpt_dir: str, known: Optional[Dict[str, Dict[str, object]]] = None) -> Dict[str, Dict[str, object]]:
    """``{relative path: {"bytes": n, "sha256": hex}}`` for every file under ``ckpt_dir``.

    Args:
        known: entries hashed while the files were written (by each rank);
            used when the size on disk agrees, so files are not read twice.

    The manifest itself and hidden files (``.done_rank_*`` markers) are left out.
    """
    files: Dict[str, Dict[str, object]] = {}
    known = known or {}
    for dirpath, _, names in os.walk(ckpt_dir):
        for name in sorted(names):
            if name == MANIFEST or name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ckpt_dir)
            size = os.path.getsize(path)
            entry = known.get(rel)
            if entry is None or entry.get("bytes") != size:
                entry = {"bytes": size, "sha256": sha256_file(path)}
            files[rel] = {"bytes": size, "sha256": entry["sha256"]}
    return files


def write_manifest(ckpt_dir: str, extra: Optional[Dict[str, object]] = None,
                   known: Optional[Dict[str, Dict[str, object]]] = None) -> Dict[str, object]:
    """Hash ``ckpt_dir`` (reusing ``known`` entries) and write its ``manifest.json``, fsynced.

    Returns:
        The manifest: ``{"files": {...}, "total_bytes": n, **extra}``.
    """
    files = build_manifest(ckpt_dir, known)
    manifest = {"files": files, "total_bytes": sum(int(f["bytes"]) for f in files.values()), **(extra or {})}
    write_json_atomic(os.path.join(ckpt_dir, MANIFEST), manifest)
    fsync_path(ckpt_dir)
    return manifest


def read_manifest(ckpt_dir: str) -> Dict[str, object]:
    """The parsed ``manifest.json`` of ``ckpt_dir``.

    Raises:
        OSError: the manifest is missing or unreadable.
        ValueError: it is not valid JSON.
    """
    with open(os.path.join(ckpt_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def verify(ckpt_dir: str, required: Optional[List[str]] = None) -> List[str]:
    """Problems found in ``ckpt_dir`` against its manifest; empty when it can be trusted.

    Args:
        ckpt_dir: one published checkpoint (``ROOT/<tag>``).
        required: relative paths that must be listed in the manifest.

    Returns:
        One message per problem, each naming the file (missing manifest,
        missing file, size or SHA-256 mismatch, required file not listed).
    """
    try:
        manifest = read_manifest(ckpt_dir)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{os.path.join(ckpt_dir, MANIFEST)}: unreadable manifest ({e})"]
    problems = []
    for rel in required or []:
        if rel not in files:
            problems.append(f"{os.path.join(ckpt_dir, rel)}: required file not in the manifest")
    for rel, want in sorted(files.items()):
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, manifest says {want['bytes']} (truncated or altered)")
        elif sha256_file(path) != want["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest (altered)")
    return problems


def write_json_atomic(path: str, obj: object, durable: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file, fsync and ``os.replace``."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True), durable)


def write_text_atomic(path: str, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync (if ``durable``) and ``os.replace``."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(staged_dir: str, root: str, tag: str) -> bool:
    """Move a fully written, manifested checkpoint to ``root/tag`` atomically.

    Args:
        staged_dir: the folder holding the files and ``manifest.json``.
        root: the checkpoint folder (same file system as ``staged_dir``).
        tag: final name.

    Returns:
        False (and nothing moved) when ``root/tag`` already exists: a step is
        published at most once.
    """
    final = os.path.join(root, tag)
    if os.path.exists(final):
        return False
    try:
        os.rename(staged_dir, final)
    except OSError:
        if os.path.exists(final):  # lost a race: someone published it first
            return False
        raise
    fsync_path(root)
    return True


def read_latest(root: str) -> Optional[str]:
    """The tag in ``root/latest``, or ``None`` when there is none."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def update_latest(root: str, tag: str) -> None:
    """Point ``root/latest`` (DeepSpeed's format) at ``tag``, atomically."""
    write_text_atomic(os.path.join(root, LATEST), tag)
    fsync_path(root)
