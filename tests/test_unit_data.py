"""ftbridge.slots.data: a unit's rows are plain data parallelism's, its random numbers its own."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ftbridge.slots import Unit
from ftbridge.slots.data import UnitSampler, unit_rng


def plain_windows(n, mb, g, world, rank, epochs, shuffle, seed):
    """Rank ``rank``'s optimizer windows under plain data parallelism: DistributedSampler + DataLoader."""
    data = list(range(n))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
    loader = DataLoader(data, batch_size=mb, sampler=sampler)
    windows = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = [b.tolist() for b in loader]
        full = len(batches) // g * g
        batches = [b for b in batches[:full] if len(b) == mb]
        windows += [batches[i:i + g] for i in range(0, len(batches) // g * g, g)]
    return windows


@pytest.mark.parametrize("n,mb,g,slots,gs,shuffle", [
    (100, 4, 2, 2, 1, True), (103, 3, 1, 3, 2, True), (64, 2, 4, 2, 2, False), (257, 5, 3, 4, 1, True)])
def test_units_read_plain_data_parallel_rows(n, mb, g, slots, gs, shuffle):
    sampler = UnitSampler(n, mb, g, slots * gs, shuffle=shuffle, seed=7)
    world, epochs = slots * gs, 3
    for slot in range(slots):
        for gr in range(gs):
            plain = plain_windows(n, mb, g, world, slot * gs + gr, epochs, shuffle, 7)
            assert len(plain) == epochs * sampler.steps_per_epoch
            for step, window in enumerate(plain):
                got = [sampler.indices(Unit(step, slot, m, gr, gs, slots)) for m in range(g)]
                assert got == window, (step, slot, gr)


def test_a_step_reads_each_row_once():
    sampler = UnitSampler(97, 3, 2, 4, seed=1)
    for step in range(3 * sampler.steps_per_epoch):
        rows = [i for slot in range(4) for m in range(2) for i in sampler.indices(Unit(step, slot, m, 0, 1, 4))]
        assert len(rows) == len(set(rows)) == 4 * 2 * 3
    assert sampler.epoch_of(sampler.steps_per_epoch) == 1


def test_for_engine_reads_the_engine_settings():
    ds = SimpleNamespace(train_micro_batch_size_per_gpu=lambda: 4, gradient_accumulation_steps=lambda: 2)
    with_slots = SimpleNamespace(cfg=SimpleNamespace(slots=3, num_replica_groups=2, group_size=2), engine=ds)
    without = SimpleNamespace(cfg=SimpleNamespace(slots=0, num_replica_groups=2, group_size=2), engine=ds)
    assert UnitSampler.for_engine(without, 1000).dp_world_size == 4
    s = UnitSampler.for_engine(with_slots, 1000)
    assert (s.dp_world_size, s.micro_batch, s.micro_steps) == (6, 4, 2)


@pytest.mark.parametrize("args,match", [
    ((0, 1, 1, 1), "num_samples=0"), ((10, True, 1, 1), "micro_batch=True"), ((10, 1, 1, 2.0), "dp_world_size=2.0"),
    ((7, 2, 2, 2), "num_samples=7 is fewer than one step's rows")])
def test_bad_settings_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        UnitSampler(*args)


def test_a_unit_of_another_grid_is_refused():
    sampler = UnitSampler(100, 2, 2, 4)
    with pytest.raises(ValueError, match="dp_world_size 2, micro 0"):
        sampler.indices(Unit(0, 0, 0, 0, 1, 2))
    with pytest.raises(ValueError, match="micro 2"):
        sampler.indices(Unit(0, 0, 2, 0, 1, 4))


def dropout_mask(unit, outer_seed):
    torch.manual_seed(outer_seed)  # the computing group's own stream differs
    with unit_rng(unit, seed=5):
        return torch.nn.functional.dropout(torch.ones(64), p=0.5)


def test_unit_rng_is_the_units_not_the_groups():
    u = Unit(3, 1, 0, 0, 1, 2)
    assert torch.equal(dropout_mask(u, 0), dropout_mask(u, 99))
    assert not torch.equal(dropout_mask(u, 0), dropout_mask(Unit(3, 0, 0, 0, 1, 2), 0))


def test_unit_rng_restores_the_callers_stream():
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    with unit_rng(Unit(0, 0, 0, 0, 1, 1)) as seed:
        torch.rand(100)
    assert seed == Unit(0, 0, 0, 0, 1, 1).seed(0)
    assert torch.equal(torch.rand(4), expected)
