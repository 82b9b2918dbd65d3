"""Replica groups on hosts of their own (ftbridge.harness.netns): a cut drops peer traffic, not the lighthouse's."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ftbridge.harness import netns

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")

SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], socket.gethostname(), flush=True)
while True:
    c, addr = s.accept()
    c.sendall(addr[0].encode())
    c.close()
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5) as s:
        print(s.recv(64).decode())
except OSError as e:
    print(type(e).__name__)
"""


def _dial(hosts, group, host, port):
    done = subprocess.run([*hosts.prefix(group), sys.executable, "-c", CLIENT, host, str(port)],
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


@pytest.mark.timeout(60)
def test_a_cut_group_reaches_the_lighthouse_but_not_its_peers_until_mended():
    with netns.GroupHosts(2) as hosts:
        peer = subprocess.Popen([*hosts.prefix(1), sys.executable, "-c", SERVER, "0.0.0.0"], stdout=subprocess.PIPE,
                                text=True)
        lighthouse = socket.create_server((hosts.lighthouse_host, 0))
        try:
            port, name = peer.stdout.readline().split()
            assert name == hosts.hostname(1)
            lh_port = lighthouse.getsockname()[1]
            # Group 0 reaches group 1 by its hostname, at its bridge address.
            assert _dial(hosts, 0, hosts.hostname(1), port) == hosts.address(0)
            hosts.cut(0)
            assert _dial(hosts, 0, hosts.hostname(1), port) in ("TimeoutError", "OSError")
            lighthouse.listen()
            lighthouse.settimeout(10)
            child = subprocess.Popen([*hosts.prefix(0), sys.executable, "-c", CLIENT, hosts.lighthouse_host,
                                      str(lh_port)], stdout=subprocess.PIPE, text=True)
            conn, _ = lighthouse.accept()  # the lighthouse link stays up while the group is cut off
            conn.sendall(b"lighthouse")
            conn.close()
            assert child.communicate(timeout=30)[0].strip() == "lighthouse"
            hosts.mend(0)
            assert _dial(hosts, 0, hosts.hostname(1), port) == hosts.address(0)
        finally:
            peer.kill()
            peer.wait(timeout=10)
            lighthouse.close()
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                             check=True).stdout.split() if ns.startswith(f"ftn{hosts.tag}")]


@pytest.mark.timeout(60)
def test_hosts_left_by_a_run_that_died_are_removed_by_the_next_one():
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
        dead = str(int(f.read()) + 1)  # no process can have it
    subprocess.run(["ip", "netns", "add", f"ftn{dead}g0"], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", f"ftb{dead}", "type", "bridge"], check=True, timeout=10)
    with netns.GroupHosts(1) as hosts:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert f"ftn{dead}g0" not in names and f"ftb{dead}" not in links
        assert hosts.namespace(0) in names  # its own are there
