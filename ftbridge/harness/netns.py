"""Replica groups on hosts of their own: one Linux network namespace per group, links a test can cut.

A cut between replica groups (a switch port lost, a partition between racks)
cannot be made on loopback: the groups' process groups, stores and heal
servers connect to each other directly. :class:`GroupHosts` gives each group
a host of its own on this machine, as a multi-node job has:

* a network namespace per group with its own hostname (a UTS namespace per
  launch) that resolves, in every group's namespace, to the group's address
  on a shared bridge: ``10.77.N.(10+g)``. The group's process groups, its
  store (``MASTER_ADDR`` is the hostname) and its heal server
  (``FTBRIDGE_HEAL_BIND``) use it, so peer traffic crosses the bridge;
* a separate point-to-point link per group to this machine's root namespace,
  where the lighthouse listens on the bridge's own address ``10.77.N.1``
  (:attr:`GroupHosts.lighthouse_host`): each group routes that one address
  over its link, from its link's address ``10.78.N.(4g+2)``, so the
  lighthouse's answers come back over the link too.

:meth:`GroupHosts.cut` detaches a group's port from the bridge: every packet
between it and its peers is dropped silently, both ways, while its
lighthouse link stays up (``partition_peer``). :meth:`GroupHosts.mend`
attaches it again. Needs root and ``ip`` (iproute2) and ``unshare``
(util-linux); :func:`available` says whether this machine has them.

By hand, the same cut is ``ip link set <port> nomaster`` (``master <bridge>``
to mend), with the names :meth:`GroupHosts.describe` prints.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import subprocess
from typing import Dict, List

logger = logging.getLogger(__name__)

IP_TIMEOUT_S = 10.0
"""Longest one ``ip`` command may take (seconds) before it counts as failed."""


def available() -> str:
    """Empty when this machine can run groups in network namespaces; otherwise the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "unshare") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    return ""


def _ip(*args: str) -> None:
    """Run ``ip args``; raise ``RuntimeError`` with its stderr when it fails."""
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


_OURS = re.compile(r"^ft[nbpl](\d+)(g\d+)?(@\S*)?:?$")


def clear_stale() -> List[str]:
    """Remove the namespaces, links and hosts files left by a harness process that died (its PID, the
    names' tag, is gone); returns what was removed. A run killed with SIGKILL cannot clean up itself."""
    from ftbridge.launch.processes import pid_alive

    def stale(name: str) -> bool:
        m = _OURS.match(name)
        return m is not None and not pid_alive(int(m.group(1)))

    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    removed = []
    for name in (line.split()[0] for line in out.stdout.splitlines() if line.strip()):
        if stale(name):
            _ip("netns", "del", name)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for line in links.stdout.splitlines():
        parts = line.split()
        name = parts[1].rstrip(":").split("@")[0] if len(parts) > 1 else ""
        if stale(name):
            try:
                _ip("link", "del", name)
            except RuntimeError:  # its peer's removal took it first
                continue
            removed.append(name)
    if removed:
        logger.warning("removed group hosts left by a run that died: %s", ", ".join(removed))
    return removed


def _free_subnet() -> int:
    """A third octet ``N`` with neither 10.77.N.0/24 nor 10.78.N.0/24 on any interface of this machine."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], check=True, capture_output=True, text=True,
                         timeout=IP_TIMEOUT_S).stdout
    used: set = set()
    for word in out.split():
        try:
            ip = str(ipaddress.ip_interface(word).ip)
        except ValueError:
            continue
        if ip.startswith(("10.77.", "10.78.")):
            used.add(int(ip.split(".")[2]))
    for n in range(1, 255):
        if n not in used:
            return n
    raise RuntimeError("no free 10.77.N.0/24 subnet for the group hosts")


class GroupHosts:
    """A bridge, one namespace per replica group, and each group's link to the lighthouse.

    Args:
        num_groups: replica groups ``0 .. num_groups - 1`` (at most 60).

    Raises:
        ValueError: ``num_groups`` out of range.
        RuntimeError: the machine cannot (:func:`available`), or an ``ip`` command failed (what was
            made so far is removed first).
    """

    def __init__(self, num_groups: int) -> None:
        if not 1 <= num_groups <= 60:
            raise ValueError(f"num_groups={num_groups}: 1 to 60 groups fit the address plan")
        why = available()
        if why:
            raise RuntimeError(f"replica groups on hosts of their own: {why}")
        clear_stale()
        self.num_groups = num_groups
        self.tag = f"{os.getpid()}"
        self.net = _free_subnet()
        self.bridge = f"ftb{self.tag}"
        self._made: List[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- names and addresses ----------------------------------------------
    def namespace(self, group: int) -> str:
        """Name of group ``group``'s network namespace."""
        return f"ftn{self.tag}g{group}"

    def hostname(self, group: int) -> str:
        """Group ``group``'s hostname (resolves to :meth:`address` in every group's namespace)."""
        return self.namespace(group)

    def address(self, group: int) -> str:
        """Group ``group``'s address on the bridge, where its peers reach it."""
        return f"10.77.{self.net}.{10 + group}"

    @property
    def lighthouse_host(self) -> str:
        """Where the lighthouse listens (in the root namespace): every group reaches it over its own link."""
        return f"10.77.{self.net}.1"

    def port(self, group: int) -> str:
        """Group ``group``'s port on the bridge (root namespace side), which :meth:`cut` detaches."""
        return f"ftp{self.tag}g{group}"

    def prefix(self, group: int) -> List[str]:
        """Command prefix that runs a command on group ``group``'s host (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.namespace(group), "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(group)]

    def describe(self) -> str:
        """The names, for a person reproducing a cut by hand."""
        return (f"bridge {self.bridge} (10.77.{self.net}.1/24); "
                + "; ".join(f"group {g}: namespace {self.namespace(g)}, {self.address(g)}, bridge port "
                            f"{self.port(g)}, lighthouse link ftl{self.tag}g{g}" for g in range(self.num_groups)))

    # -- faults -----------------------------------------------------------
    def cut(self, group: int) -> None:
        """Drop everything between group ``group`` and its peers, both ways, silently (its lighthouse link stays)."""
        _ip("link", "set", self.port(group), "nomaster")

    def mend(self, group: int) -> None:
        """Undo :meth:`cut`."""
        _ip("link", "set", self.port(group), "master", self.bridge)

    # -- life -------------------------------------------------------------
    def _build(self) -> None:
        n = self.net
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(f"link:{self.bridge}")
        _ip("addr", "add", f"10.77.{n}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(g)} {self.hostname(g)}\n"
                                                  for g in range(self.num_groups))
        for g in range(self.num_groups):
            ns = self.namespace(g)
            _ip("netns", "add", ns)
            self._made.append(f"netns:{ns}")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w", encoding="utf-8") as f:
                f.write(hosts)
            _ip("link", "add", self.port(g), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.port(g), "master", self.bridge)
            _ip("link", "set", self.port(g), "up")
            lh = f"ftl{self.tag}g{g}"
            _ip("link", "add", lh, "type", "veth", "peer", "name", "lh0", "netns", ns)
            _ip("addr", "add", f"10.78.{n}.{4 * g + 1}/30", "dev", lh)
            _ip("link", "set", lh, "up")
            for args in (("addr", "add", f"{self.address(g)}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                         ("addr", "add", f"10.78.{n}.{4 * g + 2}/30", "dev", "lh0"), ("link", "set", "lh0", "up"),
                         ("link", "set", "lo", "up"),
                         ("route", "add", f"{self.lighthouse_host}/32", "via", f"10.78.{n}.{4 * g + 1}", "dev", "lh0",
                          "src", f"10.78.{n}.{4 * g + 2}")):
                _ip("-n", ns, *args)
        logger.info("group hosts: %s", self.describe())

    def close(self) -> None:
        """Remove the namespaces, links and hosts files (processes still inside keep their sockets); idempotent."""
        for item in reversed(self._made):
            kind, name = item.split(":", 1)
            try:
                _ip(*(("netns", "del", name) if kind == "netns" else ("link", "del", name)))
            except RuntimeError as e:
                logger.warning("removing %s: %s", name, e)
            if kind == "netns":
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self._made.clear()

    def env(self, group: int) -> Dict[str, str]:
        """Environment for group ``group``'s launch: its heal server and manager advertise its bridge address."""
        return {"FTBRIDGE_HEAL_BIND": self.address(group)}

    def __enter__(self) -> "GroupHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
