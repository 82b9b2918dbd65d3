"""Unit tests for ftbridge.harness.models.char_gpt."""

import math

import pytest
import torch

from ftbridge.harness.models import GPTConfig, build_model, param_count

VOCAB = 89  # size of the Shakespeare character vocabulary


def _small(**kw):
    return GPTConfig(vocab_size=VOCAB, context=32, n_layer=2, n_head=2, d_model=32, **kw)


def test_default_param_count():
    model = build_model(GPTConfig(vocab_size=VOCAB), seed=0)
    assert model.param_count() == param_count(model) == 809_728 + 256 * VOCAB == 832_512
    # The team's reference baseline (827,648) is this model with a 70-character vocabulary.
    assert build_model(GPTConfig(vocab_size=70), seed=0).param_count() == 827_648


def test_no_shared_parameters():
    model = build_model(_small(), seed=0)
    ids = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    assert len(ids) == len(set(ids))


def test_forward_shapes_and_initial_loss():
    model = build_model(GPTConfig(vocab_size=VOCAB), seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4, 128), generator=g)
    y = torch.randint(0, VOCAB, (4, 128), generator=g)
    logits, loss = model(x, y)
    assert logits.shape == (4, 128, VOCAB) and logits.dtype == torch.float32
    assert loss.shape == () and abs(loss.item() - math.log(VOCAB)) < 0.1
    logits_short, none = model(x[:, :10])
    assert none is None and logits_short.shape == (4, 10, VOCAB)
    # Causal: the first 10 positions do not see the later ones.
    torch.testing.assert_close(logits_short, logits[:, :10])
    with pytest.raises(ValueError, match="context=128"):
        model(torch.zeros(1, 129, dtype=torch.int64))


def test_seeded_init_is_reproducible():
    a, b, c = build_model(_small(), 5), build_model(_small(), 5), build_model(_small(), 6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(_small(), seed=1)
    torch.testing.assert_close(torch.rand(3), expected)


def test_adam_steps_lower_loss():
    model = build_model(_small(), seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8, 32), generator=g)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(10):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(x, y)[1].item() < first - 0.3


def test_config_validation():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(vocab_size=10, d_model=30, n_head=4)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=0)
    with pytest.raises(TypeError):
        GPTConfig(10)  # keyword-only
