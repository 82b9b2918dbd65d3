"""Checkpoint manifest, hostile-input checks of a checkpoint folder, and atomic publication.

Publish: stage and fsync, write ``manifest.json``, one ``rename`` to ``ROOT/<tag>`` (at most once per
step), replace ``ROOT/latest`` atomically (``docs/checkpoints.md``, "How it works"). Every read here is
bounded, opens no symbolic link and reads regular files only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import stat
from typing import Any, Collection, Dict, List, Optional, Set, Tuple, cast

MANIFEST = "manifest.json"
SIGNATURE = "manifest.hmac"
LATEST = "latest"
_CHUNK = 1 << 20
MAX_JSON_BYTES = 16 << 20
"""Largest ``manifest.json`` / ``ftbridge.json`` / ``latest`` read (bytes); larger is refused unread."""
MAX_FILE_BYTES = 1 << 50
"""Largest file size a manifest may declare (bytes)."""
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def read_bounded(path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit``; a link, FIFO or device is never read.

    Raises ``OSError`` if missing or unreadable (``ELOOP``: a symbolic link), ``ValueError`` if not a
    regular file or larger than ``limit``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def parse_json(data: bytes, what: str) -> Any:
    """Strict JSON (UTF-8, no ``NaN``/``Infinity``/``1e309``, bounded nesting); ValueError naming ``what``."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{what}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def check_relpath(rel: Any) -> str:
    """``rel`` if it names a file inside the checkpoint folder: relative, ``/``-separated, at most 4096
    characters, no ``..``/``.``/empty part, NUL or backslash, not the manifest itself; else ValueError.
    """
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or "\x00" in rel or "\\" in rel:
        raise ValueError(f"manifest path {rel!r} is not a plain relative path")
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"manifest path {rel!r} leaves the checkpoint folder or is not normalised")
    if rel in (MANIFEST, SIGNATURE):
        raise ValueError(f"manifest path {rel!r} is the manifest itself")
    return rel


def is_int(value: Any, lo: int, hi: int) -> bool:
    """Whether ``value`` is an ``int`` (not ``bool``) with ``lo <= value <= hi``."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def check_manifest(obj: Any) -> Dict[str, Any]:
    """``obj`` if shaped ``{"files": {relpath: {"bytes": int, "sha256": 64 hex}}, "total_bytes": int,
    "tag": str, "step": int}`` (last three optional, extra keys ignored); else ValueError on the first bad field.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("files"), dict):
        raise ValueError("manifest is not an object with a \"files\" object")
    total = 0
    for rel, entry in obj["files"].items():
        check_relpath(rel)
        if (not isinstance(entry, dict) or not is_int(entry.get("bytes"), 0, MAX_FILE_BYTES)
                or not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"])):
            raise ValueError(f"manifest entry {rel!r} is not {{\"bytes\": int, \"sha256\": 64 hex digits}}")
        total += entry["bytes"]
    if obj.get("total_bytes", total) != total:
        raise ValueError(f"manifest total_bytes {obj.get('total_bytes')!r} is not the sum of its files ({total})")
    if "step" in obj and not is_int(obj["step"], 0, 2**62):
        raise ValueError(f"manifest step {obj['step']!r} is not a non-negative integer")
    if "tag" in obj and not isinstance(obj["tag"], str):
        raise ValueError(f"manifest tag {obj['tag']!r} is not a string")
    return obj


def sha256_file(path: str, limit: Optional[int] = None) -> str:
    """Hex SHA-256 of a regular file, reading at most ``limit + 1`` bytes.

    Raises ``OSError`` if missing, unreadable or a symbolic link, ``ValueError`` if not a regular file.
    """
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        left = MAX_FILE_BYTES if limit is None else limit + 1
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def fsync_path(path: str) -> None:
    """fsync a file or a folder (folder: makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_manifest(ckpt_dir: str, known: Optional[Dict[str, Dict[str, object]]] = None) -> Dict[str, Dict[str, object]]:
    """``{relative path: {"bytes", "sha256"}}`` of every file under ``ckpt_dir`` except the manifest and
    hidden files, reusing a ``known`` entry (hashed while writing) whose size agrees.
    """
    files: Dict[str, Dict[str, object]] = {}
    known = known or {}
    for dirpath, _, names in os.walk(ckpt_dir):
        for name in sorted(names):
            if name in (MANIFEST, SIGNATURE) or name.startswith("."):
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
                   known: Optional[Dict[str, Dict[str, object]]] = None,
                   key: Optional[bytes] = None) -> Dict[str, object]:
    """Hash ``ckpt_dir`` and write ``manifest.json`` (with ``key``: also ``manifest.hmac``), fsynced.

    Returns the manifest: ``{"files": {...}, "total_bytes": n, **extra}``.
    """
    files = build_manifest(ckpt_dir, known)
    manifest = {"files": files, "total_bytes": sum(int(cast(int, f["bytes"])) for f in files.values()), **(extra or {})}
    text = json.dumps(manifest, indent=1, sort_keys=True)
    write_text_atomic(os.path.join(ckpt_dir, MANIFEST), text)
    if key is not None:
        write_text_atomic(os.path.join(ckpt_dir, SIGNATURE), sign(key, text.encode("utf-8")))
    fsync_path(ckpt_dir)
    return manifest


def sign(key: bytes, data: bytes) -> str:
    """HMAC-SHA256 of ``data`` under ``key``, as 64 hex digits."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def read_manifest(ckpt_dir: str, key: Optional[bytes] = None) -> Dict[str, Any]:
    """The shape-checked ``manifest.json`` of ``ckpt_dir`` (bounded read); with ``key``, HMAC checked first.

    Raises:
        OSError: missing, unreadable or a symbolic link.
        ValueError: not a regular file, too large, not JSON, wrong shape, or a missing or wrong HMAC.
    """
    data = read_bounded(os.path.join(ckpt_dir, MANIFEST))
    if key is not None:
        try:
            mac = read_bounded(os.path.join(ckpt_dir, SIGNATURE), 256).decode("ascii", "replace").strip()
        except OSError as e:
            raise ValueError(f"{os.path.join(ckpt_dir, SIGNATURE)}: missing or unreadable ({e}); a checkpoint key "
                             "is configured, so an unsigned manifest is not trusted") from None
        if not hmac.compare_digest(mac, sign(key, data)):
            raise ValueError(f"{os.path.join(ckpt_dir, SIGNATURE)}: the manifest's HMAC does not match the "
                             "checkpoint key (tampered, or signed with another key)")
    return check_manifest(parse_json(data, os.path.join(ckpt_dir, MANIFEST)))


def scan_folder(ckpt_dir: str) -> Tuple[Set[str], List[str]]:
    """Regular files under ``ckpt_dir`` (relative paths), and problems with anything else (links are never followed)."""
    files: Set[str] = set()
    problems: List[str] = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(ckpt_dir, rel_dir)) as it:
            for entry in it:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.is_symlink():
                    problems.append(f"{entry.path}: symbolic link (a checkpoint holds regular files only)")
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    if rel not in (MANIFEST, SIGNATURE):
                        files.add(rel)
                else:
                    problems.append(f"{entry.path}: not a regular file (FIFO, device or socket)")
    return files, problems


def verify(ckpt_dir: str, required: Optional[List[str]] = None, key: Optional[bytes] = None,
           hashed_later: Collection[str] = ()) -> List[str]:
    """Problems of ``ckpt_dir`` against its manifest, one message per problem naming the file; empty: trusted.

    Checks the manifest (bounded, shape, HMAC with ``key``), that exactly the listed regular files exist
    (no link, FIFO, device or unlisted file), sizes, SHA-256 (except ``hashed_later`` paths, which the
    caller hashes as it reads them) and that ``required`` paths are listed. Nothing outside ``ckpt_dir``
    is opened or measured.
    """
    if os.path.islink(ckpt_dir) or not os.path.isdir(ckpt_dir):
        return [f"{ckpt_dir}: not a folder (or a symbolic link to one)"]
    try:
        files = read_manifest(ckpt_dir, key)["files"]
        on_disk, problems = scan_folder(ckpt_dir)
    except (OSError, ValueError) as e:
        return [f"{os.path.join(ckpt_dir, MANIFEST)}: unreadable manifest ({e})"]
    for rel in required or []:
        if rel not in files:
            problems.append(f"{os.path.join(ckpt_dir, rel)}: required file not in the manifest")
    for rel in sorted(on_disk - set(files)):
        problems.append(f"{os.path.join(ckpt_dir, rel)}: not in the manifest (added, or its entry removed)")
    for rel, want in sorted(files.items()):
        path = os.path.join(ckpt_dir, rel)
        if rel not in on_disk:
            problems.append(f"{path}: missing" + ("" if not os.path.lexists(path) else " (not a regular file)"))
            continue
        try:
            size = os.lstat(path).st_size
            if size != want["bytes"]:
                problems.append(f"{path}: {size} bytes, manifest says {want['bytes']} (truncated or altered)")
            elif rel not in hashed_later and sha256_file(path, want["bytes"]) != want["sha256"]:
                problems.append(f"{path}: SHA-256 differs from the manifest (altered)")
        except (OSError, ValueError) as e:
            problems.append(f"{path}: unreadable ({e})")
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
    """Rename the manifested ``staged_dir`` to ``root/tag`` atomically; False, moving nothing, if it exists."""
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
    """The tag in ``root/latest`` (a bounded read of a regular file); ``None`` when absent or unreadable."""
    try:
        text = read_bounded(os.path.join(root, LATEST), 4096).decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return None
    return text or None


def update_latest(root: str, tag: str) -> None:
    """Point ``root/latest`` (DeepSpeed's format) at ``tag``, atomically."""
    write_text_atomic(os.path.join(root, LATEST), tag)
    fsync_path(root)


def checkpoint_files(ckpt_dir: str) -> List[str]:
    """The ``.pt`` files directly in ``ckpt_dir`` (not following links), sorted."""
    with os.scandir(ckpt_dir) as it:
        return sorted(e.path for e in it if e.name.endswith(".pt") and e.is_file(follow_symlinks=False))
