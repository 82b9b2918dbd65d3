"""Reading a lighthouse (ftbridge/manager/lighthouse_status.py: torchft 0.2's status fragment) and
``ftbridge-lighthouse status`` (lighthouse/status.py: the table and JSON output, the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from ftbridge.manager.lighthouse_status import StatusFormatError, fetch_status, parse_status, status_url
from lighthouse.server import start_lighthouse
from lighthouse.status import format_json, format_table

REPO = Path(__file__).resolve().parents[1]

# Verbatim GET /status of torchft 0.2.0's lighthouse after a quorum of two members (steps 5 and 6).
FRAGMENT = (
    '\nCurrent quorum_id: 1 <br>\nNext quorum status: New quorum not ready, only have 0 participants, need '
    'min_replicas 2 [0/0 participants healthy][2 heartbeating][shrink_only=false]\n\n<h3>Previous Quorum</h3>\n\n\n'
    'Previous quorum id: 1 <br>\nNum participants: 2 <br>\nQuorum age:\n0.019231593s\n\n<div>\n\n\n'
    '<div class="member\n recovering\n">\n  <b>replica_group_0:uuid0</b> <br/>\n  Step: 5 <br/>\n'
    '  Manager: http://h:0 <br/>\n  TCPStore: h:100 <br/>\n  World size: 2 <br/>\n\n'
    '  <button hx-post="/replica/replica_group_0:uuid0/kill"\n          hx-trigger="click">\n    Kill\n'
    '  </button>\n</div>\n\n\n\n<div class="member\n \n">\n  <b>replica_group_1:uuid1</b> <br/>\n  Step: 6 <br/>\n'
    '  Manager: http://h:1 <br/>\n  TCPStore: h:101 <br/>\n  World size: 2 <br/>\n\n'
    '  <button hx-post="/replica/replica_group_1:uuid1/kill"\n          hx-trigger="click">\n    Kill\n'
    '  </button>\n</div>\n\n\n</div>\n\n\n\n<h2>Heartbeats</h2>\n\n<ul>\n\n\n  \n  <li class="heartbeat\n    \n  ">\n'
    '    replica_group_0:uuid0: seen 0.019847163s ago\n  </li>\n\n\n\n  \n  <li class="heartbeat\n    old\n  ">\n'
    '    replica_group_1:uuid1: seen 7.5s ago\n  </li>\n\n\n</ul>'
)
EMPTY = ("\nCurrent quorum_id: 0 <br>\nNext quorum status: New quorum not ready, only have 0 participants, need "
         "min_replicas 1 [0/0 participants healthy][0 heartbeating][shrink_only=false]\n\n<h3>Previous Quorum</h3>\n"
         "\n\n\n<h2>Heartbeats</h2>\n\n<ul>\n\n</ul>")


def test_parse_members_steps_sizes_addresses_and_heartbeat_ages():
    st = parse_status(FRAGMENT)
    assert st.quorum_id == 1 and st.previous_quorum_id == 1
    assert st.quorum_age_s == pytest.approx(0.019231593)
    assert "need min_replicas 2" in st.next_quorum
    m0, m1 = st.members
    assert (m0.replica_id, m0.replica_group, m0.step, m0.world_size) == ("replica_group_0:uuid0", 0, 5, 2)
    assert (m0.manager_address, m0.store_address, m0.recovering) == ("http://h:0", "h:100", True)
    assert (m1.replica_group, m1.step, m1.recovering) == (1, 6, False)
    assert m0.heartbeat_age_s == pytest.approx(0.019847163) and m1.heartbeat_age_s == 7.5
    assert [h.stale for h in st.heartbeats] == [False, True]


def test_parse_before_the_first_quorum():
    st = parse_status(EMPTY)
    assert st.quorum_id == 0 and st.previous_quorum_id is None and st.members == [] and st.heartbeats == []
    assert "no quorum issued yet" in format_table(st)


@pytest.mark.parametrize("body, needle", [
    ("<html>hello</html>", "Current quorum_id"),
    (FRAGMENT.replace("Step: 5", "Stp: 5"), "'Step'"),
    (FRAGMENT.replace("seen 7.5s ago", "last 7.5s"), "not 'ID: seen Ns ago'"),
])
def test_foreign_or_changed_page_raises_format_error_naming_what_is_missing(body, needle):
    with pytest.raises(StatusFormatError, match=needle):
        parse_status(body)


def test_table_and_json_show_every_column():
    st = parse_status(FRAGMENT)
    table = format_table(st)
    header = table.splitlines()[2]
    for col in ("group", "replica_id", "step", "group_size", "manager", "heartbeat"):
        assert col in header
    assert "replica_group_0:uuid0" in table and "recovering" in table and "7.5s" in table
    data = json.loads(format_json(st))
    assert [(m["replica_group"], m["step"], m["world_size"]) for m in data["members"]] == [(0, 5, 2), (1, 6, 2)]


def test_status_url_accepts_urls_and_host_port():
    assert status_url("http://a:1/") == "http://a:1/status"
    assert status_url("a:1") == "http://a:1/status"


@pytest.mark.timeout(60)
def test_fetch_from_a_real_lighthouse_and_cli_status(tmp_path):
    from torchft._torchft import LighthouseClient

    with start_lighthouse("127.0.0.1:0", min_replicas=2, join_timeout_ms=100) as lh:
        def join(i: int) -> None:
            client = LighthouseClient(lh.address, timedelta(seconds=5))
            client.heartbeat(f"replica_group_{i}:u{i}")
            client.quorum(f"replica_group_{i}:u{i}", timedelta(seconds=20), address=f"http://m{i}:1",
                          store_address=f"s{i}:2", step=10 + i, world_size=3)

        threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        st = fetch_status(lh.address)
        assert [(m.replica_group, m.step, m.world_size, m.manager_address) for m in st.members] == [
            (0, 10, 3, "http://m0:1"), (1, 11, 3, "http://m1:1")]
        out = subprocess.run([sys.executable, "-m", "lighthouse.cli", "status", lh.address],
                             cwd=REPO, capture_output=True, text=True, timeout=50, check=False)
        assert out.returncode == 0, out.stderr
        assert "replica_group_1:u1" in out.stdout and "http://m1:1" in out.stdout
        port = lh.port
    out = subprocess.run([sys.executable, "-m", "lighthouse.cli", "status", f"127.0.0.1:{port}", "--timeout-s", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 1 and "cannot read the status" in out.stderr


def test_a_port_that_does_not_speak_http_is_a_format_error_not_a_traceback():
    import socket
    import threading

    from ftbridge.manager.lighthouse_status import StatusFormatError, fetch_status

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer_garbage():
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x12\x04not http at all\r\n\r\n")

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        with pytest.raises(StatusFormatError, match="did not answer as an HTTP server"):
            fetch_status(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
    finally:
        thread.join(timeout=5)
        server.close()
