"""Heal transport: serves a healthy rank's live state to a joining replica group.

Implements torchft's :class:`torchft.checkpointing.CheckpointTransport`
interface, so torchft's ``Manager`` drives it unchanged (``send_checkpoint``
on the donor while the step's quorum is being computed, ``recv_checkpoint`` on
the joiner, ``disallow_checkpoint`` once the donor's step may mutate state).

Why not torchft's own ``HTTPTransport``: it binds every interface and loads
what it receives with ``torch.load(weights_only=False)``, i.e. with pickle:
whoever answers the joiner's request can run code on it. This transport

* binds only the interface given (``FTBridgeConfig.heal_bind``);
* sends a nested ``dict[str, ...]`` whose leaves are tensors or JSON scalars
  (``int``, ``float``, ``bool``, ``str``, ``None``) as one body::

      8-byte little-endian header length | JSON header | safetensors blob

  The header maps ``"a/b/c"`` key paths to either ``{"v": scalar}`` or
  ``{"t": tensor_name}``; tensors live in the safetensors blob. Neither JSON
  nor safetensors executes code on load. Anything else in the state is
  refused with ``TypeError`` on the sending side.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torchft.checkpointing.transport import CheckpointTransport

from ftbridge import faults

logger = logging.getLogger(__name__)

_SCALARS = (bool, int, float, str, type(None))
_SEP = "/"


def encode_state(state: Dict[str, Any]) -> bytes:
    """Serialise a nested dict of tensors and JSON scalars without pickle.

    Args:
        state: nested ``dict`` with ``str`` keys (no ``"/"`` in keys); leaves
            are ``torch.Tensor`` (any dtype safetensors supports, any device:
            copied to contiguous CPU memory) or ``int``/``float``/``bool``/
            ``str``/``None``.

    Returns:
        The wire format described in the module docstring.

    Raises:
        TypeError: a leaf or key of another type (name and path in the message).
    """
    header: Dict[str, Any] = {}
    tensors: Dict[str, torch.Tensor] = {}
    storages: set = set()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if not node and path:
                header[path] = {"d": True}
            for key, value in node.items():
                if not isinstance(key, str) or _SEP in key or not key:
                    raise TypeError(f"heal state key {key!r} at {path or '<root>'!r} must be a non-empty str "
                                    "without '/'")
                walk(value, f"{path}{_SEP}{key}" if path else key)
        elif isinstance(node, torch.Tensor):
            name = f"t{len(tensors)}"
            t = node.detach().to("cpu").contiguous()
            # safetensors refuses tensors sharing a storage (state dicts hold views of flat
            # buffers): copy only those; the others are copied once, by st_save itself.
            storage = t.untyped_storage().data_ptr()
            if storage in storages:
                t = t.clone()
            storages.add(storage)
            tensors[name] = t
            header[path] = {"t": name}
        elif isinstance(node, _SCALARS):
            header[path] = {"v": node}
        else:
            raise TypeError(
                f"heal state leaf {path!r} is a {type(node).__name__}; only tensors and JSON "
                "scalars are sent (no pickle): convert it in the state function"
            )

    walk(state, "")
    head = json.dumps(header).encode()
    blob = st_save(tensors) if tensors else b""
    return struct.pack("<Q", len(head)) + head + blob


def decode_state(body: bytes) -> Dict[str, Any]:
    """Inverse of :func:`encode_state`; tensors come back on CPU.

    Raises:
        ValueError: the body is truncated or not in this format.
    """
    n = _header_length(body[:8], len(body))
    return decode_parts(body[8 : 8 + n], body[8 + n :])


def _header_length(prefix: bytes, body_len: int) -> int:
    """The JSON header's length from the body's 8-byte prefix, checked against ``body_len`` (bytes)."""
    if len(prefix) < 8 or body_len < 8:
        raise ValueError(f"heal state body of {body_len} bytes is truncated")
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > body_len:
        raise ValueError(f"heal state header of {n} bytes exceeds body of {body_len} bytes")
    return n


# safetensors dtype names (its format spec) for the zero-copy view; any other dtype goes through st_load.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _view_blob(blob: bytearray) -> Dict[str, torch.Tensor]:
    """Tensors of a safetensors blob as views of ``blob`` (no copy; they keep it alive and may write to it).

    ``safetensors.torch.load`` copies every tensor out of its ``bytes``; at
    256 MB that copy took as long as the transfer itself. The layout read here
    is the safetensors format (8-byte little-endian header length, JSON header
    of ``dtype``/``shape``/``data_offsets`` per tensor, then the data), with
    every offset checked against the blob. A dtype outside :data:`_ST_DTYPES`
    or a big-endian host falls back to ``safetensors.torch.load``.

    Raises:
        ValueError: a header or offset that does not fit the blob.
    """
    view = memoryview(blob)
    n = _header_length(view[:8], len(view))  # safetensors frames its header as this module frames the body
    header = json.loads(bytes(view[8 : 8 + n]))
    header.pop("__metadata__", None)
    if sys.byteorder != "little" or any(info.get("dtype") not in _ST_DTYPES for info in header.values()):
        return st_load(bytes(blob))
    base, size, out = 8 + n, len(view) - 8 - n, {}
    for name, info in header.items():
        dtype, shape, (begin, end) = _ST_DTYPES[info["dtype"]], list(info["shape"]), info["data_offsets"]
        numel = math.prod(shape)
        if not 0 <= begin <= end <= size or end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets {begin}..{end} do not hold shape {shape} of {info['dtype']} "
                             f"in {size} bytes")
        out[name] = (torch.frombuffer(blob, dtype=dtype, count=numel, offset=base + begin).reshape(shape) if numel
                     else torch.empty(shape, dtype=dtype))
    return out


def decode_parts(head: bytes, blob: Any) -> Dict[str, Any]:
    """:func:`decode_state` of a body already split into its JSON header and safetensors blob.

    The receiver reads the two apart, into a ``bytearray`` for the blob
    (nearly all of the bytes), whose tensors are then views of it: no copy
    between the socket and the tensors. A ``bytes`` blob is loaded by
    ``safetensors.torch.load`` (one copy).

    Raises:
        ValueError: a malformed header or blob.
    """
    try:
        header = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"heal state header is not JSON: {e}") from None
    try:
        tensors = (_view_blob(blob) if isinstance(blob, bytearray) else st_load(bytes(blob))) if blob else {}
    except Exception as e:  # safetensors raises its own error type on a corrupt blob
        raise ValueError(f"heal state tensor blob is corrupt: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"heal state header is a {type(header).__name__}, not a mapping")
    for path, entry in header.items():
        if not path or not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in "tvd":
            raise ValueError(f"heal state header entry {path!r}: {entry!r} is not one of t/v/d")
        if "t" in entry and entry["t"] not in tensors:
            raise ValueError(f"heal state header entry {path!r} names missing tensor {entry['t']!r}")
    out: Dict[str, Any] = {}
    for path, entry in header.items():
        *parents, leaf = path.split(_SEP)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if "t" in entry:
            node[leaf] = tensors[entry["t"]]
        elif "d" in entry:
            node.setdefault(leaf, {})
        else:
            node[leaf] = entry["v"]
    return out


def _read_into(resp: Any, view: memoryview) -> int:
    """Fill ``view`` from the HTTP response; returns the bytes read (fewer if the body ended early)."""
    got = 0
    while got < len(view):
        k = resp.readinto(view[got:])
        if not k:
            break
        got += k
    return got


class SafeHTTPTransport(CheckpointTransport[Dict[str, Any]]):
    """torchft checkpoint transport over HTTP with a pickle-free format.

    The donor serialises its state in :meth:`send_checkpoint` (in torchft's
    quorum thread, overlapping the forward pass) and serves it until
    :meth:`disallow_checkpoint`; the joiner fetches ``GET /heal/{step}``.

    Args:
        bind: interface address to listen on, e.g. ``"127.0.0.1"``; port is
            chosen by the OS.
        timeout: socket timeout for serving and fetching.

    Raises:
        OSError: ``bind`` is not an address of this machine.
    """

    def __init__(self, bind: str, timeout: timedelta) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._body: Optional[bytes] = None
        self._step = -1
        self.last_recv: Optional[Dict[str, Any]] = None
        """Timing of the last successful fetch (the heal benchmark reads it): ``bytes``, and wall
        times (seconds since the epoch) ``start``, ``fetched`` (body received) and ``end`` (decoded)."""
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "heal" or not parts[1].isdigit():
                    self.send_error(404, "expected /heal/STEP")
                    return
                body = transport._wait_for(int(parts[1]))
                if body is None:
                    self.send_error(409, f"step {parts[1]} is not being served")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                view, half = memoryview(body), len(body) // 2  # no copies of the body
                self.wfile.write(view[:half])
                self.wfile.flush()
                faults.point("heal_send")
                self.wfile.write(view[half:])

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("heal transport: " + fmt, *args)

        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        server_cls = type("_HealServer", (ThreadingHTTPServer,), {"address_family": family})
        self._server = server_cls((bind, 0), Handler)
        self._server.daemon_threads = True
        self._server.timeout = timeout.total_seconds()
        host = f"[{bind}]" if family == socket.AF_INET6 else bind
        self._address = f"http://{host}:{self._server.server_address[1]}/heal/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="ftbridge-heal", daemon=True)
        self._thread.start()
        logger.info("heal transport serving on %s", self._address)

    def _wait_for(self, step: int) -> Optional[bytes]:
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._cond:
            while self._body is None or self._step != step:
                if self._step > step:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    return None
            return self._body

    def metadata(self) -> str:
        """URL prefix of this transport, passed to joiners through the quorum."""
        return self._address

    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: Dict[str, Any],
                        timeout: timedelta) -> None:
        """Serialise ``state_dict`` and serve it for ``step`` until :meth:`disallow_checkpoint`.

        Raises:
            TypeError: the state holds a leaf that is neither tensor nor JSON scalar.
        """
        t0 = time.perf_counter()
        body = encode_state(state_dict)
        with self._cond:
            self._body, self._step = body, step
            self._cond.notify_all()
        logger.info("serving heal state for step %d to replica ranks %s: %.1f MB encoded in %.3f s",
                    step, dst_ranks, len(body) / 1e6, time.perf_counter() - t0)

    def disallow_checkpoint(self) -> None:
        """Stop serving: the donor's state may change from here on."""
        with self._cond:
            self._body = None
            self._cond.notify_all()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Dict[str, Any]:
        """Fetch and decode the donor's state for ``step``.

        Raises:
            urllib.error.URLError / OSError: the donor is unreachable or died.
            ConnectionError / http.client.IncompleteRead: the body ended early
                (the donor died while sending).
            ValueError: a malformed body.
        """
        url = f"{metadata}{step}"
        t0 = time.perf_counter()
        wall0 = time.time()
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as resp:
            size = int(resp.headers.get("Content-Length", "0"))
            # Header and blob read apart, the blob straight into the buffer its tensors will view
            # (no concatenation or slicing copies of the whole body).
            prefix = resp.read(8)
            n = _header_length(prefix, size)
            head = resp.read(n)
            faults.point("heal_recv")
            blob = bytearray(size - 8 - n)
            got = len(prefix) + len(head) + _read_into(resp, memoryview(blob))
        if got != size:
            raise ConnectionError(f"heal state for step {step} from {url}: received {got} of {size} bytes "
                                  "(the donor died or the connection broke)")
        fetched = time.time()
        state = decode_parts(head, blob)
        self.last_recv = {"bytes": size, "start": wall0, "fetched": fetched, "end": time.time()}
        logger.info("received heal state for step %d from replica rank %d (%s): %.1f MB in %.3f s",
                    step, src_rank, url, size / 1e6, time.perf_counter() - t0)
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop the HTTP server."""
        self.disallow_checkpoint()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
