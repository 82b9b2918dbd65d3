"""What a heal carries beyond DeepSpeed's state: registered entries (ftbridge.heal.extra) and the random
number generators (ftbridge.heal.rng), applied before a restarted group's first forward."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ftbridge.heal import rng
from ftbridge.heal.extra import ExtraState
from ftbridge.heal.wire import decode_state, encode_state
from ftbridge.zero.state import from_wire, to_wire
from tests.fakes import gpt_batch, tiny_engine


def _draws():
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()), torch.randn(2).tolist())


def test_the_generators_travel_through_the_wire_and_continue_the_stream():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # Python keeps a spare Gaussian in its state
    sent = rng.state_dict()
    want = _draws()
    torch.manual_seed(99)  # the joiner's own, different stream
    random.seed(99)
    np.random.seed(99)
    received = decode_state(encode_state(to_wire(sent)))
    rng.load_state_dict(from_wire(rng.state_dict(), received))
    assert _draws() == want


def test_an_entry_read_at_the_step_start_is_carried_as_read_and_applied_once_before_forward():
    value, loaded, other = {"n": 1}, [], []
    extra = ExtraState()
    extra.register("rng", lambda: dict(value), loaded.append, at_step_start=True)
    extra.register("data", lambda: {"pos": 5}, other.append)
    with pytest.raises(ValueError, match="'rng' is already registered"):
        extra.register("rng", dict, print)
    extra.begin_step()
    value["n"] = 2  # the forward moves it on: a joiner still gets the step's start
    assert extra.wire() == {"rng": {"n": 1}, "data": {"pos": 5}}
    extra.load({"rng": {"n": 7}, "data": {"pos": 9}}, before_forward=True)
    assert loaded == [{"n": 7}] and other == []
    extra.load({"rng": {"n": 7}, "data": {"pos": 9}})  # the step's full load leaves the early one alone
    assert loaded == [{"n": 7}] and other == [{"pos": 9}]
    extra.end_step()
    assert extra.wire()["rng"] == {"n": 2}, "between steps: read when asked"
    extra.begin_step()
    extra.load({"rng": {"n": 8}})
    assert loaded[-1] == {"n": 8}, "a new step forgets what was applied early in the last one"


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.timeout(120)
def test_a_restarted_group_takes_the_donors_generators_before_its_first_forward():
    """A dropout model: the joiner's forward of the heal step draws the donor's masks, so that both end the
    step with one random state; its later load in should_commit does not set it back."""
    from ftbridge.harness.models import GPTConfig, build_model
    from tests.fakes import TINY_GPT

    def engine():
        eng = tiny_engine(2, model=build_model(GPTConfig(**TINY_GPT, dropout=0.3), seed=3))
        eng.register_state("rng", rng.state_dict, rng.load_state_dict, at_step_start=True)
        return eng

    donor, joiner = engine(), engine()
    x, y = gpt_batch(0)
    torch.manual_seed(5)
    donor(x, y)
    sent = donor.heal_state()  # read by the quorum thread during the donor's step
    after_donor = torch.get_rng_state()
    torch.manual_seed(77)  # the restarted group's own stream
    joiner._heal_first = True
    joiner.manager.pending = decode_state(encode_state(sent))
    joiner(x, y)
    assert torch.equal(torch.get_rng_state(), after_donor), "the joiner's forward drew other masks"
    joiner.extra.load(joiner.manager.pending["replica"]["extra"])  # as in should_commit
    assert torch.equal(torch.get_rng_state(), after_donor), "the step's load set the generators back"


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.timeout(120)
def test_a_group_healed_mid_step_takes_the_donors_generators_as_they_stood_at_its_vote():
    """A dropout model, the joiner's forward run on its own stream (it learnt of its heal mid-step): after the
    committed heal step it holds the donor's generators as the donor's forward and backward left them, not the
    ones read at the step's start (one step behind)."""
    from ftbridge.harness.models import GPTConfig, build_model
    from tests.fakes import TINY_GPT

    def engine():
        eng = tiny_engine(2, model=build_model(GPTConfig(**TINY_GPT, dropout=0.3), seed=3))
        eng.register_state("rng", rng.state_dict, rng.load_state_dict, at_step_start=True)
        return eng

    def step(eng):
        _, loss = eng(*gpt_batch(0))
        eng.backward(loss)
        eng.step()

    donor, joiner, bystander = engine(), engine(), engine()
    torch.manual_seed(5)
    step(donor)
    after_donor = torch.get_rng_state()
    body = donor.manager.step_end_sent
    assert body is not None, "the donor wrote nothing at its vote"

    torch.manual_seed(77)  # the joiner's own stream; it heals in this step
    joiner.manager.healed_this_step = True
    joiner.manager.transport = SimpleNamespace(last_recv=None)  # the step's record reads the heal's fetch times
    joiner.manager.step_end = body
    step(joiner)
    assert joiner.last_committed
    assert torch.equal(torch.get_rng_state(), after_donor), "the joiner did not take the donor's step-end state"

    torch.manual_seed(77)  # a rank that healed nothing keeps its own stream
    bystander.manager.step_end = body
    step(bystander)
    assert not torch.equal(torch.get_rng_state(), after_donor)

    joiner.manager.step_end = b"not an encoding"  # a bad body: warned, the rank keeps its state
    torch.manual_seed(78)
    step(joiner)
    assert joiner.last_committed and not torch.equal(torch.get_rng_state(), after_donor)
