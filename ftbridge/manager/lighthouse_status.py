"""Read a running torchft 0.2 lighthouse's state (quorum, members, heartbeats) from ``GET /status``.

:func:`fetch_status` fetches the HTML fragment torchft's dashboard polls; :func:`parse_status` (pure)
parses it into :class:`LighthouseStatus`, or raises :class:`StatusFormatError` naming what is missing.
Why not gRPC: its only methods change the lighthouse's state (``Quorum`` joins the next quorum, and a
``Heartbeat`` adds a replica id that then counts in the split-brain guard and makes a quorum that changes
membership wait ``join_timeout_ms`` for it); docs/lighthouse.md, "Status". Example:
``fetch_status("http://127.0.0.1:29510").quorum_id``.
"""

from __future__ import annotations

import html
import http.client
import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional


class StatusFormatError(ValueError):
    """The status route answered with text that is not torchft 0.2's status fragment."""


@dataclass(frozen=True)
class Member:
    """One participant of the last quorum."""

    replica_id: str
    """torchft replica id, ``replica_group_G:UUID`` for ftbridge groups (the UUID changes on a restart)."""
    step: int
    """Committed steps the group reported when it asked for this quorum."""
    world_size: int
    """Ranks in the replica group (its group size)."""
    manager_address: str
    """Address of the group's torchft manager server (group rank 0)."""
    store_address: str
    """``HOST:PORT`` of the group's TCPStore."""
    recovering: bool
    """Behind the quorum's highest step: this group heals from a peer."""
    heartbeat_age_s: Optional[float] = None
    """Seconds since the lighthouse last heard from it (``None``: never)."""

    @property
    def replica_group(self) -> Optional[int]:
        """ftbridge's replica group id parsed from ``replica_group_G:...``, else ``None``."""
        return replica_group_of(self.replica_id)


def replica_group_of(replica_id: str) -> Optional[int]:
    """ftbridge's replica group id in a torchft replica id ``replica_group_G:UUID``, else ``None``."""
    match = re.match(r"replica_group_(\d+)(:|$)", replica_id)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Heartbeat:
    """The lighthouse's last contact with one replica id."""

    replica_id: str
    age_s: float
    """Seconds since its last heartbeat or quorum request."""
    stale: bool
    """Older than the lighthouse's heartbeat timeout: counted as dead."""


@dataclass(frozen=True)
class LighthouseStatus:
    """One snapshot of a lighthouse; ``quorum_id`` is its current quorum id (it starts over with a restart)."""

    quorum_id: int
    next_quorum: str
    """torchft's explanation of whether the next quorum can form."""
    previous_quorum_id: Optional[int] = None
    """Id of the last quorum issued (``None`` before the first)."""
    quorum_age_s: Optional[float] = None
    """Seconds since the last quorum was issued."""
    members: List[Member] = field(default_factory=list)
    heartbeats: List[Heartbeat] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict (members gain ``replica_group``)."""
        out = asdict(self)
        for m, d in zip(self.members, out["members"]):
            d["replica_group"] = m.replica_group
        return out


_NUM = r"(-?[0-9.]+(?:e-?[0-9]+)?)"


def _text(fragment: str) -> str:
    """The fragment's text: tags removed, entities decoded, whitespace collapsed per line."""
    no_tags = re.sub(r"<[^>]*>", "\n", fragment)
    lines = (" ".join(line.split()) for line in html.unescape(no_tags).splitlines())
    return "\n".join(line for line in lines if line)


def parse_status(fragment: str) -> LighthouseStatus:
    """Parse torchft 0.2's ``GET /status`` fragment; members carry their heartbeat age.

    Raises:
        StatusFormatError: no current quorum id, or a member block or heartbeat entry lacks a field (named).
    """
    current = re.search(r"Current quorum_id:\s*(-?\d+)", fragment)
    if current is None:
        raise StatusFormatError(
            "no 'Current quorum_id' in the status page: not a torchft 0.2 lighthouse, or its "
            f"template changed; got {fragment[:200]!r}")
    nxt = re.search(r"Next quorum status:\s*(.*?)\s*(?:<h3>|$)", fragment, re.S)
    previous = re.search(r"Previous quorum id:\s*(-?\d+)", fragment)
    age = re.search(r"Quorum age:\s*" + _NUM + r"s", fragment)

    heartbeats = []
    for li in re.finditer(r'<li class="heartbeat(.*?)">(.*?)</li>', fragment, re.S):
        hb = re.fullmatch(r"\s*(.*?): seen " + _NUM + r"s ago\s*", html.unescape(li.group(2)), re.S)
        if hb is None:
            raise StatusFormatError(f"heartbeat entry {li.group(2).strip()!r} is not 'ID: seen Ns ago'")
        heartbeats.append(Heartbeat(hb.group(1), float(hb.group(2)), "old" in li.group(1).split()))
    ages = {h.replica_id: h.age_s for h in heartbeats}

    members = []
    for block in re.finditer(r'<div class="member(.*?)">(.*?)</div>', fragment, re.S):
        body = block.group(2)

        def field_of(label: str, body: str = body) -> str:
            found = re.search(label + r":\s*(.*?)\s*<br", body, re.S)
            if found is None:
                raise StatusFormatError(f"quorum member block has no {label!r}: {_text(body)!r}")
            return html.unescape(found.group(1))

        rid = re.search(r"<b>(.*?)</b>", body, re.S)
        if rid is None:
            raise StatusFormatError(f"quorum member block has no replica id: {_text(body)!r}")
        replica_id = html.unescape(rid.group(1)).strip()
        members.append(Member(
            replica_id=replica_id,
            step=int(field_of("Step")),
            world_size=int(field_of("World size")),
            manager_address=field_of("Manager"),
            store_address=field_of("TCPStore"),
            recovering="recovering" in block.group(1).split(),
            heartbeat_age_s=ages.get(replica_id),
        ))
    return LighthouseStatus(
        quorum_id=int(current.group(1)),
        next_quorum=_text(nxt.group(1)) if nxt else "",
        previous_quorum_id=int(previous.group(1)) if previous else None,
        quorum_age_s=float(age.group(1)) if age else None,
        members=members,
        heartbeats=heartbeats,
    )


MAX_STATUS_BYTES = 4 << 20
"""Largest status page read (bytes)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses redirects: urllib then raises ``HTTPError`` with the 3xx code."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# http/https only, no proxy from the environment (one could see and answer for the lighthouse), no redirect
_OPENER = urllib.request.OpenerDirector()
for _handler in (urllib.request.ProxyHandler({}), urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                 urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(), _NoRedirect()):
    _OPENER.add_handler(_handler)


def fetch_status(address: str, timeout_s: float = 5.0) -> LighthouseStatus:
    """GET ``{address}`` (``http(s)://HOST:PORT`` or ``HOST:PORT``) ``/status`` and parse it; no proxy, no redirect,
    ``timeout_s`` per connect and read.

    Raises:
        ValueError: not an ``http``/``https`` address.
        OSError: unreachable, or an HTTP error or redirect.
        StatusFormatError: not torchft 0.2's status fragment, over :data:`MAX_STATUS_BYTES`, or not HTTP.
    """
    url = status_url(address)
    try:
        with _OPENER.open(url, timeout=timeout_s) as resp:
            raw = resp.read(MAX_STATUS_BYTES + 1)
    except http.client.HTTPException as exc:  # not an HTTP server: e.g. the lighthouse's gRPC health port
        raise StatusFormatError(f"{url} did not answer as an HTTP server ({type(exc).__name__}); give the "
                                "lighthouse's own address (ftbridge-lighthouse serve --bind), not another port "
                                "of it") from None
    if len(raw) > MAX_STATUS_BYTES:
        raise StatusFormatError(f"the status page at {url} is larger than {MAX_STATUS_BYTES} bytes")
    return parse_status(raw.decode("utf-8", errors="replace"))


def status_url(address: str) -> str:
    """``http://HOST:PORT/status`` for a lighthouse address (``HOST:PORT`` or a URL); ``ValueError`` for a scheme other
    than ``http``/``https``."""
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    scheme = address.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"lighthouse address {address!r}: only http:// or https:// (or HOST:PORT) is read; "
                         "give the lighthouse's http address")
    return f"{address}/status"
