"""Unit tests for ftbridge.events: parameter checksums, the JSON-lines writer and reader."""

import json
import threading

import pytest
import torch

from ftbridge.events import EventLog, read_events, tensor_checksum

# -- tensor_checksum -------------------------------------------------------------

def _params(seed):
    torch.manual_seed(seed)
    return [torch.randn(4, 3), torch.randn(3), torch.tensor(2.5), torch.randn(2, 2).to(torch.bfloat16)]


def test_checksum_is_16_lowercase_hex():
    digest = tensor_checksum(_params(0))
    assert len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


def test_checksum_equal_for_equal_tensors_in_separate_storage():
    a, b = _params(0), [t.clone() for t in _params(0)]
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(a, b))
    assert tensor_checksum(a) == tensor_checksum(b)


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(3.0),
    lambda: torch.tensor(7, dtype=torch.int64),
    lambda: torch.tensor([1.5, -2.25, 3.0]).to(torch.bfloat16),
    lambda: torch.tensor(1.0, dtype=torch.bfloat16),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.arange(6, dtype=torch.float16).reshape(2, 3),
    lambda: torch.empty(0),
])
def test_checksum_equal_for_equal_single_tensors(make):
    assert tensor_checksum([make()]) == tensor_checksum([make()])


def test_checksum_changes_when_one_element_changes():
    base = _params(0)
    reference = tensor_checksum(base)
    for i, t in enumerate(base):
        changed = [x.clone() for x in base]
        flat = changed[i].view(-1)
        flat[-1] = flat[-1] + 1
        assert tensor_checksum(changed) != reference, f"change in tensor {i} ({t.dtype}) not detected"


def test_checksum_sees_the_lowest_bit_of_bf16_and_the_sign_of_zero():
    x = torch.tensor([1.0], dtype=torch.bfloat16)
    bumped = (x.view(torch.int16) + 1).view(torch.bfloat16)
    assert tensor_checksum([x]) != tensor_checksum([bumped])
    assert tensor_checksum([torch.tensor(0.0)]) != tensor_checksum([torch.tensor(-0.0)])


def test_checksum_differs_when_only_the_dtype_differs():
    # All-zero tensors have identical bytes; the dtype alone must tell them apart.
    zeros = torch.zeros
    assert tensor_checksum([zeros(4, dtype=torch.float32)]) != tensor_checksum([zeros(4, dtype=torch.int32)])
    assert tensor_checksum([zeros(2, dtype=torch.float16)]) != tensor_checksum([zeros(2, dtype=torch.bfloat16)])
    assert tensor_checksum([torch.tensor(1.0)]) != tensor_checksum([torch.tensor(1.0, dtype=torch.float64)])


def test_checksum_depends_on_order():
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    assert tensor_checksum([a, b]) != tensor_checksum([b, a])


def test_checksum_of_views_and_params_equals_that_of_contiguous_copies():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()
    assert not view.is_contiguous()
    assert tensor_checksum([view]) == tensor_checksum([view.contiguous()])
    p = torch.nn.Parameter(torch.randn(3))
    assert tensor_checksum([p]) == tensor_checksum([p.detach().clone()])
    assert tensor_checksum(iter([p])) == tensor_checksum([p])  # any iterable, e.g. a generator


def test_checksum_of_model_parameters_tracks_an_optimizer_step():
    torch.manual_seed(0)
    m1, m2 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    m2.load_state_dict(m1.state_dict())
    assert tensor_checksum(m1.parameters()) == tensor_checksum(m2.parameters())
    opt = torch.optim.SGD(m1.parameters(), lr=0.1)
    m1(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert tensor_checksum(m1.parameters()) != tensor_checksum(m2.parameters())


def test_checksum_of_no_tensors_is_stable():
    assert tensor_checksum([]) == tensor_checksum(iter(()))


# -- EventLog ----------------------------------------------------------------------

def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_event_log_writes_json_lines_with_identity_fields(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path), identity={"replica_group": 1, "group_rank": 0})
    log.write(time=1.0, step=1, committed=True, loss=2.5, replica_rank=None)
    log.write(time=2.0, step=2, committed=False, loss=None, event="heal")
    log.close()
    lines = _lines(path)
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"replica_group": 1, "group_rank": 0, "time": 1.0, "step": 1, "committed": True,
                     "loss": 2.5, "replica_rank": None}
    assert list(first)[:2] == ["replica_group", "group_rank"]  # identity first
    assert second["event"] == "heal" and second["replica_group"] == 1 and second["loss"] is None


def test_event_log_flushes_every_record(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path), identity={"replica_group": 0})
    try:
        log.write(time=1.0, step=1)
        # Readable by another reader before close: a killed process loses at most the line being written.
        assert read_events([str(path)]) == [{"replica_group": 0, "time": 1.0, "step": 1}]
    finally:
        log.close()


def test_event_log_creates_parent_folders_and_appends(tmp_path):
    path = tmp_path / "a" / "b" / "ev.jsonl"
    log = EventLog(str(path), identity={"group_rank": 3})
    log.write(time=1.0)
    log.close()
    log = EventLog(str(path), identity={"group_rank": 3})  # a restarted process appends
    log.write(time=2.0)
    log.close()
    assert [r["time"] for r in read_events([str(path)])] == [1.0, 2.0]


def test_event_log_without_path_is_a_no_op(tmp_path):
    log = EventLog(None, identity={"replica_group": 0})
    log.write(time=1.0, step=1)
    log.close()
    assert log.path is None and list(tmp_path.iterdir()) == []


def test_event_log_close_is_idempotent_and_later_writes_are_dropped(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path))
    log.write(time=1.0)
    log.close()
    log.close()
    log.write(time=2.0)
    assert [json.loads(x)["time"] for x in _lines(path)] == [1.0]


def test_event_log_rejects_non_json_fields_without_writing_a_partial_line(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path))
    with pytest.raises(TypeError):
        log.write(time=1.0, tensor=torch.ones(1))
    log.write(time=2.0)
    log.close()
    assert [json.loads(x) for x in _lines(path)] == [{"time": 2.0}]


@pytest.mark.timeout(30)
def test_event_log_concurrent_writers_produce_whole_lines(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path), identity={"replica_group": 0})
    n_threads, per_thread = 4, 200
    payload = "x" * 500  # long lines make interleaving visible if the lock were missing

    def writer(tid):
        for i in range(per_thread):
            log.write(time=float(i), thread=tid, i=i, pad=payload)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=20)
    log.close()
    records = [json.loads(line) for line in _lines(path)]  # every line parses
    assert len(records) == n_threads * per_thread
    assert {(r["thread"], r["i"]) for r in records} == {(t, i) for t in range(n_threads) for i in range(per_thread)}


# -- read_events ---------------------------------------------------------------------

def _write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")


def test_read_events_merges_files_sorted_by_time(tmp_path):
    a, b = tmp_path / "g0.jsonl", tmp_path / "g1.jsonl"
    _write_jsonl(a, [{"time": 1.0, "g": 0, "step": 1}, {"time": 3.0, "g": 0, "step": 2}, {"time": 5.0, "g": 0}])
    _write_jsonl(b, [{"time": 2.0, "g": 1, "step": 1}, {"time": 4.0, "g": 1, "step": 2}])
    events = read_events([str(a), str(b)])
    assert [e["time"] for e in events] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [e["g"] for e in events] == [0, 1, 0, 1, 0]


def test_read_events_sort_is_stable_for_equal_times_and_missing_time_first(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_jsonl(a, [{"time": 1.0, "id": "a1"}, {"time": 1.0, "id": "a2"}])
    _write_jsonl(b, [{"time": 1.0, "id": "b1"}, {"id": "no-time"}])
    assert [e["id"] for e in read_events([str(a), str(b)])] == ["no-time", "a1", "a2", "b1"]


def test_read_events_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "ev.jsonl"
    _write_jsonl(path, [{"time": 1.0, "step": 1}, {"time": 2.0, "step": 2}], tail='{"time": 3.0, "st')
    assert read_events([str(path)]) == [{"time": 1.0, "step": 1}, {"time": 2.0, "step": 2}]


def test_read_events_skips_torn_line_written_by_a_killed_writer(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path), identity={"replica_group": 2})
    log.write(time=1.0, step=1)
    log.close()
    full = path.read_bytes()
    record = json.dumps({"replica_group": 2, "time": 2.0, "step": 2}).encode()
    for cut in range(1, len(record)):  # a kill at every byte of the next record
        path.write_bytes(full + record[:cut])
        assert read_events([str(path)]) == [{"replica_group": 2, "time": 1.0, "step": 1}], cut


def test_read_events_ignores_blank_lines_and_missing_files(tmp_path):
    path = tmp_path / "ev.jsonl"
    path.write_text('\n{"time": 1.0}\n\n   \n{"time": 0.5}\n', encoding="utf-8")
    assert read_events([str(path), str(tmp_path / "absent.jsonl")]) == [{"time": 0.5}, {"time": 1.0}]
    assert read_events([]) == []


def test_read_events_accepts_any_iterable_of_paths(tmp_path):
    path = tmp_path / "ev.jsonl"
    _write_jsonl(path, [{"time": 1.0}])
    assert read_events(p for p in [str(path)]) == [{"time": 1.0}]


def test_first_record_after_a_torn_line_survives_a_restart(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(str(path), identity={"replica_group": 0})
    log.write(time=1.0, step=1)
    log.close()
    with open(path, "a", encoding="utf-8") as f:  # the killed process's partial record
        f.write('{"replica_group": 0, "time": 2.0, "st')
    log = EventLog(str(path), identity={"replica_group": 0})  # the restarted process
    log.write(time=3.0, step=2)
    log.close()
    assert [e["time"] for e in read_events([str(path)])] == [1.0, 3.0]
