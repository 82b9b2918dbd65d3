"""The heal wire format: a nested dict of tensors and JSON scalars, without pickle.

Body: ``8-byte little-endian header length | JSON header | safetensors blob``; the header maps
``"a/b/c"`` key paths to ``{"t": tensor_name}``, ``{"v": JSON scalar}`` or ``{"d": true}`` (empty dict).

Hostile input: :func:`decode_state` and :func:`decode_parts` end every input in ``ValueError`` or a
valid result (nested ``dict`` with non-empty ``str`` keys, tensor or JSON-scalar leaves, no two tensors
sharing bytes, no more tensor bytes than the body holds), in time and memory linear in the body's
size. The blob is checked as strictly as ``safetensors`` checks a file (header at most 100 MB,
``data_offsets`` tiling the data exactly, sizes matching dtype and shape), also on the zero-copy path.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_SCALARS = (bool, int, float, str, type(None))
_SEP = "/"
MAX_DEPTH = 64
"""Most key-path components a decoded state may have."""
ST_MAX_HEADER_BYTES = 100_000_000
"""``safetensors``' own limit on its JSON header (``MAX_HEADER_SIZE``), bytes."""
HEADER_SLACK_BYTES = 1 << 20
"""Bytes allowed for a peer's headers on top of twice our own: :func:`size_bound`."""

# safetensors dtype names (its format spec) for the zero-copy view; any other dtype goes through st_load.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


_DTYPE_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


@dataclass(frozen=True)
class BodyPlan:
    """A body laid out but not yet copied: ``prefix`` then the bytes of ``tensors`` in order."""

    prefix: bytes
    """8-byte length, JSON header, and the safetensors blob's own length and header."""
    tensors: Tuple[torch.Tensor, ...]
    """The state's tensors in blob order, live (not copied, any device, maybe non-contiguous)."""
    size: int
    """Bytes of the whole body."""


def _flatten(state: Dict[str, Any]) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """The JSON header of ``state`` and its tensors in header order (not copied); TypeError on a bad key or leaf."""
    header: Dict[str, Any] = {}
    tensors: List[torch.Tensor] = []
    stack: List[Tuple[str, Any]] = [("", state)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if not node and path:
                header[path] = {"d": True}
            for key in reversed(list(node)):
                if not isinstance(key, str) or _SEP in key or not key:
                    raise TypeError(f"heal state key {key!r} at {path or '<root>'!r} must be a non-empty str "
                                    "without '/'")
                stack.append((f"{path}{_SEP}{key}" if path else key, node[key]))
        elif isinstance(node, torch.Tensor):
            header[path] = {"t": f"t{len(tensors)}"}
            tensors.append(node)
        elif isinstance(node, _SCALARS):
            header[path] = {"v": node}
        else:
            raise TypeError(
                f"heal state leaf {path!r} is a {type(node).__name__}; only tensors and JSON "
                "scalars are sent (no pickle): convert it in the state function"
            )
    return header, tensors


def plan_body(state: Dict[str, Any]) -> Optional[BodyPlan]:
    """Lay out the body :func:`encode_state` would return, copying no tensor data.

    Returns ``None`` if a tensor's dtype is outside :data:`_ST_DTYPES`. Raises ``TypeError`` as
    :func:`encode_state` does.
    """
    header, tensors = _flatten(state)
    if any(t.dtype not in _DTYPE_NAMES for t in tensors):
        return None
    head = json.dumps(header).encode()
    blob_head, end = b"", 0
    if tensors:
        entries = {}
        for i, t in enumerate(tensors):
            n = t.numel() * t.element_size()
            entries[f"t{i}"] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [end, end + n]}
            end += n
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes so that the data is aligned
        blob_head = struct.pack("<Q", len(raw)) + raw
    prefix = struct.pack("<Q", len(head)) + head + blob_head
    return BodyPlan(prefix, tuple(tensors), len(prefix) + end)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat ``uint8`` CPU tensor: a view if ``t`` is contiguous on the CPU, else a copy."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def encode_state(state: Dict[str, Any]) -> bytes:
    """Serialise a nested dict of tensors and JSON scalars without pickle.

    Args:
        state: nested ``dict`` with non-empty ``str`` keys without ``"/"``; leaves ``torch.Tensor`` (any
            safetensors dtype, any device) or ``int``/``float``/``bool``/``str``/``None``.

    Raises:
        TypeError: a leaf or key of another type (name and path in the message).
    """
    plan = plan_body(state)
    if plan is None:
        return _encode_with_safetensors(state)
    out = bytearray(plan.size)
    out[: len(plan.prefix)] = plan.prefix
    dst = torch.frombuffer(out, dtype=torch.uint8) if plan.size else torch.empty(0, dtype=torch.uint8)
    pos = len(plan.prefix)
    for t in plan.tensors:
        src = tensor_bytes(t)
        dst[pos : pos + len(src)].copy_(src)
        pos += len(src)
    return bytes(out)


def _encode_with_safetensors(state: Dict[str, Any]) -> bytes:
    """:func:`encode_state` for dtypes :func:`plan_body` does not lay out: ``safetensors`` writes the blob."""
    header, flat = _flatten(state)
    tensors: Dict[str, torch.Tensor] = {}
    storages: set = set()
    for i, node in enumerate(flat):
        t = node.detach().to("cpu").contiguous()
        # safetensors refuses tensors sharing a storage (state dicts hold views of flat buffers): copy those.
        storage = t.untyped_storage().data_ptr()
        if storage in storages:
            t = t.clone()
        storages.add(storage)
        tensors[f"t{i}"] = t
    head = json.dumps(header).encode()
    blob = st_save(tensors) if tensors else b""
    return struct.pack("<Q", len(head)) + head + blob


def size_bound(state: Dict[str, Any], extra_bytes: int = 0) -> int:
    """Largest body (bytes) accepted from a peer for a state shaped like our own ``state``; copies no tensor.

    Tensor bytes + ``extra_bytes`` (state the peer may hold and we not yet) + twice our JSON headers +
    :data:`HEADER_SLACK_BYTES`.
    """
    tensor_bytes, header = 0, 0
    stack: List[Tuple[str, Any]] = [("", state)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}/{k}", v) for k, v in node.items())
            header += 32 + len(path.encode())
        elif isinstance(node, torch.Tensor):
            tensor_bytes += node.numel() * node.element_size()
            header += 2 * len(path.encode()) + 96 + 24 * node.dim()
        else:
            header += 2 * len(path.encode()) + 32 + (6 * len(node) if isinstance(node, str) else 32)
    return tensor_bytes + max(0, int(extra_bytes)) + 2 * header + HEADER_SLACK_BYTES


def decode_state(body: bytes) -> Dict[str, Any]:
    """Inverse of :func:`encode_state`, tensors on CPU; ValueError for any malformed body (module contract)."""
    n = header_length(body[:8], len(body))
    return decode_parts(body[8 : 8 + n], body[8 + n :])


def header_length(prefix: Union[bytes, memoryview], body_len: int) -> int:
    """The JSON header's length from the 8-byte prefix; ValueError if truncated or longer than ``body_len``."""
    if len(prefix) < 8 or body_len < 8:
        raise ValueError(f"heal state body of {body_len} bytes is truncated")
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > body_len:
        raise ValueError(f"heal state header of {n} bytes exceeds body of {body_len} bytes")
    return n


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _st_entries(header: Any, size: int) -> List[Tuple[str, str, List[int], int, int]]:
    """``(name, dtype, shape, begin, end)`` per tensor, sorted; tiling ``0..size`` exactly, as safetensors checks."""
    if not isinstance(header, dict):
        raise ValueError(f"safetensors header is a {type(header).__name__}, not a mapping")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("safetensors __metadata__ is not a mapping of strings")
    entries = []
    for name, info in header.items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}
                and isinstance(info["dtype"], str) and isinstance(info["shape"], list)
                and all(_is_count(d) for d in info["shape"]) and isinstance(info["data_offsets"], list)
                and len(info["data_offsets"]) == 2 and all(_is_count(o) for o in info["data_offsets"])):
            raise ValueError(f"tensor {name!r}: {str(info)[:200]} is not {{dtype, shape, data_offsets}}")
        entries.append((name, info["dtype"], info["shape"], *info["data_offsets"]))
    entries.sort(key=lambda e: (e[3], e[4]))
    start = 0
    for name, dtype, shape, begin, end in entries:
        if begin != start or end < begin:
            raise ValueError(f"tensor {name!r}: data_offsets {begin}..{end} overlap or leave a gap "
                             f"(the previous tensor ends at {start})")
        if dtype in _ST_DTYPES and end - begin != math.prod(shape) * _ST_DTYPES[dtype].itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets {begin}..{end} do not hold shape {shape} of {dtype}")
        start = end
    if start != size:
        raise ValueError(f"safetensors data of {size} bytes, but its tensors end at byte {start}")
    return entries


def blob_entries(raw_header: bytes, data_size: int) -> List[Tuple[str, torch.dtype, List[int], int, int]]:
    """Checked ``(name, dtype, shape, begin, end)`` per tensor of a blob header, for a receiver reading the data itself.

    ``raw_header`` is the blob's JSON header (at most :data:`ST_MAX_HEADER_BYTES`), ``data_size`` the
    bytes that follow it. Raises ValueError for a malformed header, offsets that do not tile ``data_size``
    exactly, or a dtype outside the zero-copy set.
    """
    if not raw_header.startswith(b"{"):
        raise ValueError("safetensors header does not start with '{'")
    entries = []
    for name, dtype_name, shape, begin, end in _st_entries(_json(raw_header, "safetensors header"), data_size):
        if dtype_name not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype_name} is not one the heal can receive onto a device")
        entries.append((name, _ST_DTYPES[dtype_name], shape, begin, end))
    return entries


def _view_blob(blob: bytearray) -> Dict[str, torch.Tensor]:
    """Tensors of a safetensors blob as views of ``blob``, no copy (``docs/heal.md``, "Zero-copy decode").

    Other dtypes or a big-endian host fall back to ``safetensors.torch.load``. ValueError on a bad header.
    """
    view = memoryview(blob)
    n = header_length(view[:8], len(view))  # safetensors frames its header as this module frames the body
    if n > ST_MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header of {n} bytes exceeds safetensors' limit of {ST_MAX_HEADER_BYTES}")
    raw = bytes(view[8 : 8 + n])
    if not raw.startswith(b"{"):
        raise ValueError("safetensors header does not start with '{'")
    entries = _st_entries(_json(raw, "safetensors header"), len(view) - 8 - n)
    if sys.byteorder != "little" or any(dtype not in _ST_DTYPES for _, dtype, *_ in entries):
        return st_load(bytes(blob))
    base, out = 8 + n, {}
    for name, dtype_name, shape, begin, end in entries:
        dtype = _ST_DTYPES[dtype_name]
        numel = (end - begin) // dtype.itemsize
        out[name] = (torch.frombuffer(blob, dtype=dtype, count=numel, offset=base + begin).reshape(shape) if numel
                     else torch.empty(shape, dtype=dtype))
    return out


def _json(raw: Any, what: str) -> Any:
    """``json.loads`` whose every failure (bad UTF-8, bad JSON, nesting too deep, huge int) is a ValueError."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"heal state {what} is not JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _checked_entries(header: Any, tensors: Dict[str, torch.Tensor]) -> List[Tuple[List[str], str, Any]]:
    """``(key path, kind, value)`` per header entry; every tensor of the blob named exactly once."""
    if not isinstance(header, dict):
        raise ValueError(f"heal state header is a {type(header).__name__}, not a mapping")
    out, named = [], set()
    for path, entry in header.items():
        parts = path.split(_SEP)
        if not all(parts) or len(parts) > MAX_DEPTH:
            raise ValueError(f"heal state header path {path[:200]!r} has an empty component or more than "
                             f"{MAX_DEPTH} levels")
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in ("t", "v", "d"):
            raise ValueError(f"heal state header entry {path[:200]!r}: {str(entry)[:200]} is not one of t/v/d")
        kind, value = next(iter(entry.items()))
        if kind == "t" and (not isinstance(value, str) or value not in tensors or value in named):
            raise ValueError(f"heal state header entry {path[:200]!r} names a missing or already used tensor "
                             f"{str(value)[:200]!r}")
        if (kind == "v" and not isinstance(value, _SCALARS)) or (kind == "d" and value is not True):
            raise ValueError(f"heal state header entry {path[:200]!r}: {kind}={str(value)[:200]} is not a "
                             "JSON scalar / true")
        if kind == "t":
            named.add(value)
        out.append((parts, kind, value))
    if len(named) != len(tensors):
        raise ValueError(f"heal state blob holds {len(tensors) - len(named)} tensor(s) the header does not name")
    return out


def decode_parts(head: bytes, blob: Any) -> Dict[str, Any]:
    """:func:`decode_state` of a body already split into its JSON header and blob.

    A writable ``blob`` (``bytearray``, writable ``memoryview``) is decoded into views of it, no copy;
    ``bytes`` through ``safetensors.torch.load``. ValueError as for :func:`decode_state`.
    """
    header = _json(head, "header")
    writable = isinstance(blob, bytearray) or (isinstance(blob, memoryview) and not blob.readonly)
    try:
        if isinstance(blob, dict):  # already read and checked: ftbridge.staging.read_tensors (GPU joiners)
            tensors = blob
        else:
            tensors = (_view_blob(blob) if writable else st_load(bytes(blob))) if len(blob) else {}
    except ValueError as e:
        raise ValueError(f"heal state tensor blob is corrupt: {e}") from None
    except Exception as e:  # noqa: BLE001 - hostile bytes: whatever safetensors raises becomes ValueError
        raise ValueError(f"heal state tensor blob is corrupt: {type(e).__name__}: {str(e)[:200]}") from None
    out: Dict[str, Any] = {}
    for parts, kind, value in _checked_entries(header, tensors):
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"heal state header path {_SEP.join(parts)[:200]!r} goes through a leaf")
        leaf: Optional[Any] = node.get(parts[-1])
        if leaf is not None or parts[-1] in node:
            if not (kind == "d" and isinstance(leaf, dict)):
                raise ValueError(f"heal state header path {_SEP.join(parts)[:200]!r} is given twice")
        elif kind == "d":
            node[parts[-1]] = {}
        else:
            node[parts[-1]] = tensors[value] if kind == "t" else value
    return out
