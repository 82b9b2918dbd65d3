"""The Accelerate integration's pieces, in one process (no network, no launcher).

* re-sharding: every rank of every replica group reads, epoch after epoch, exactly the rows Accelerate's
  own ``prepare_data_loader`` gives plain data-parallel rank ``G * group_size + R`` of ``N * group_size``,
  with equal lengths everywhere, and after ``skip_first_batches`` too;
* the scheduler: :class:`ReplicaGroupsScheduler` in a group of ``gs`` processes gives, step after step
  (skipped steps, accumulation micro-steps and a ``OneCycleLR`` cap included), the learning rates
  Accelerate's own wrapper gives on ``N * gs`` processes;
* a discarded step reads as skipped to Accelerate's DeepSpeed optimizer wrapper and holds the learning rate;
* with slots, ``accelerator.backward`` over ``units()`` steps DeepSpeed once, after the step's last unit;
* the refusals, each naming the setting.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.data_loader import prepare_data_loader, skip_first_batches
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import GradientState

from ftbridge.integrations.accelerate import (
    FaultTolerantAccelerator,
    ReplicaGroupsScheduler,
    check_accelerate_version,
    mark_discarded_steps,
    settings_refusal,
    sync_on_the_last_unit,
)
from ftbridge.integrations.accelerate_data import shard_across_replica_groups

pytestmark = pytest.mark.timeout(120)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class Rows(torch.utils.data.Dataset):
    """Row ``i`` is ``i``: a batch shows which rows it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n, batch, drop_last, shuffle):
    return torch.utils.data.DataLoader(Rows(n), batch_size=batch, drop_last=drop_last, shuffle=shuffle)


def _prepared(n, batch, drop_last, shuffle, processes, index, **kw):
    """What ``accelerator.prepare`` gives a world of ``processes`` (Accelerate's own function, as it calls it)."""
    return prepare_data_loader(_loader(n, batch, drop_last, shuffle), None, num_processes=processes,
                               process_index=index, put_on_device=False, use_seedable_sampler=shuffle,
                               data_seed=11 if shuffle else None, **kw)


def _epochs(loader, epochs):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


CASES = list(itertools.product([2, 3], [1, 2], [1, 3], [5, 17, 24], [False, True], [False, True]))
"""(replica groups, group size, batch size, dataset rows, drop_last, shuffle)."""


@pytest.mark.parametrize("movable", [False, True], ids=["shard", "movable"])
@pytest.mark.parametrize("groups,gs,batch,n,drop_last,shuffle", CASES)
def test_every_rank_reads_the_rows_of_plain_data_parallelism(groups, gs, batch, n, drop_last, shuffle, movable):
    lengths = set()
    for g, r in itertools.product(range(groups), range(gs)):
        ours = shard_across_replica_groups(_prepared(n, batch, drop_last, shuffle, gs, r), num_replica_groups=groups,
                                           replica_group_id=g, group_size=gs, group_rank=r, movable=movable)
        plain = _prepared(n, batch, drop_last, shuffle, groups * gs, g * gs + r)
        got, want = _epochs(ours, 3), _epochs(plain, 3)
        assert got == want, f"group {g} rank {r}"
        if shuffle and len(want[0]) > 1:
            assert want[0] != want[1], "the order changes from epoch to epoch (set_epoch reaches the sampler)"
        lengths.add(len(ours))
        assert len(ours) == len(plain) == len(got[0])
    assert len(lengths) == 1, f"every rank of every group has the same number of batches: {lengths}"


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_rows_after_skip_first_batches_are_plain_data_parallelisms(skip):
    for g, r in itertools.product(range(2), range(2)):
        ours = shard_across_replica_groups(_prepared(29, 2, False, True, 2, r), num_replica_groups=2,
                                           replica_group_id=g, group_size=2, group_rank=r)
        plain = _prepared(29, 2, False, True, 4, g * 2 + r)
        assert [b.tolist() for b in skip_first_batches(ours, skip)] == \
            [b.tolist() for b in skip_first_batches(plain, skip)]


def _stream(loader, epochs):
    """Plain data parallelism's training stream: every epoch's batches, epoch after epoch."""
    return [b for epoch in _epochs(loader, epochs) for b in epoch]


@pytest.mark.parametrize("drawn,position", [(1, 7), (3, 0), (0, 12), (4, 4), (5, 25)])
def test_a_moved_loader_reads_the_stream_from_the_new_position_and_keeps_the_loops_epochs(drawn, position):
    """Moved after the loop drew ``drawn`` batches (one more prefetched below), the loader reads plain data
    parallelism's stream from ``position`` on, across epoch ends, while every ``iter()`` still yields
    ``len()`` batches: the loop's epochs and stop rule are unchanged."""
    ours = shard_across_replica_groups(_prepared(23, 2, False, True, 1, 0), num_replica_groups=2,
                                       replica_group_id=1, group_size=1, group_rank=0, movable=True)
    stream = _stream(_prepared(23, 2, False, True, 2, 1), 6)
    n = len(ours)
    got, it = [], iter(ours)
    got += [next(it).tolist() for _ in range(drawn)]
    ours.move_to(position)
    got += [b.tolist() for b in it]
    assert len(got) == n, "one iteration yields len() batches, moved or not"
    assert got[:drawn] == stream[:drawn] and got[drawn:] == stream[position:position + n - drawn]
    assert ours.position == position + n - drawn
    second = [b.tolist() for b in ours]  # the loop's next epoch: still ahead by the move
    assert second == stream[position + n - drawn:position + 2 * n - drawn]


def test_a_reassigned_loader_reads_the_rows_of_its_new_rank():
    """A warm spare's loader, sharded as group 0 before it took group 2's id, then pointed at group 2."""
    ours = shard_across_replica_groups(_prepared(31, 2, False, True, 2, 1), num_replica_groups=3,
                                       replica_group_id=0, group_size=2, group_rank=1, movable=True)
    ours.reassign(replica_group_id=2, group_size=2, group_rank=1)
    assert _epochs(ours, 2) == _epochs(_prepared(31, 2, False, True, 6, 5), 2)
    for bad in ({"replica_group_id": 3, "group_size": 2, "group_rank": 0},
                {"replica_group_id": 0, "group_size": 2, "group_rank": 2}):
        with pytest.raises(ValueError, match="outside"):
            ours.reassign(**bad)


def test_a_movable_loader_skips_as_skip_first_batches_does():
    ours = shard_across_replica_groups(_prepared(29, 2, False, True, 2, 1), num_replica_groups=2,
                                       replica_group_id=0, group_size=2, group_rank=1, movable=True)
    plain = _prepared(29, 2, False, True, 4, 1)
    ours.set_epoch(1)
    plain.set_epoch(1)
    assert [b.tolist() for b in ours.skip_first(3)] == [b.tolist() for b in skip_first_batches(plain, 3)]
    plain.set_epoch(2)
    assert ours.iteration == 2 and [b.tolist() for b in ours] == _epochs(plain, 1)[0]
    with pytest.raises(ValueError, match="position -1"):
        ours.move_to(-1)


def test_the_union_of_all_ranks_is_the_dataset_once_per_epoch():
    seen = []
    for g in range(3):
        ours = shard_across_replica_groups(_prepared(24, 2, False, True, 1, 0), num_replica_groups=3,
                                           replica_group_id=g, group_size=1, group_rank=0)
        seen += [i for b in ours for i in b.tolist()]
    assert sorted(seen) == list(range(24))


@pytest.mark.parametrize("what,prepare_kw,match", [
    ("uneven", dict(even_batches=False), "even_batches=False"),
    ("split", dict(split_batches=True), "split_batches=True"),
    ("random", dict(use_seedable_sampler=False), "use_seedable_sampler=True"),
])
def test_loaders_that_cannot_be_exact_are_refused(what, prepare_kw, match):
    kw = dict(num_processes=2, process_index=0, put_on_device=False, use_seedable_sampler=True)
    kw.update(prepare_kw)
    loader = prepare_data_loader(_loader(10, 2, False, True), None, **kw)
    with pytest.raises(ValueError, match=match):
        shard_across_replica_groups(loader, num_replica_groups=2, replica_group_id=0, group_size=2, group_rank=0)


def test_other_loaders_are_refused_with_the_fix():
    args = dict(num_replica_groups=2, replica_group_id=0, group_size=1, group_rank=0)
    once = shard_across_replica_groups(_prepared(10, 2, False, False, 1, 0), **args)
    with pytest.raises(ValueError, match="once"):
        shard_across_replica_groups(once, **args)
    with pytest.raises(ValueError, match="first, then accelerator.skip_first_batches"):
        shard_across_replica_groups(skip_first_batches(_prepared(10, 2, False, False, 1, 0), 1), **args)
    with pytest.raises(ValueError, match="accelerator.prepare returned"):
        shard_across_replica_groups(_loader(10, 2, False, False), **args)
    sampler = torch.utils.data.DistributedSampler(Rows(10), num_replicas=2, rank=0)
    loader = prepare_data_loader(torch.utils.data.DataLoader(Rows(10), batch_size=2, sampler=sampler), None,
                                 num_processes=1, process_index=0, put_on_device=False)
    with pytest.raises(ValueError, match="DistributedSampler"):
        shard_across_replica_groups(loader, **args)
    iterable = torch.utils.data.DataLoader(torch.utils.data.IterableDataset.__new__(_Stream), batch_size=2)
    with pytest.raises(ValueError, match="IterableDataset"):
        shard_across_replica_groups(prepare_data_loader(iterable, None, num_processes=1, process_index=0,
                                                        put_on_device=False), **args)
    with pytest.raises(ValueError, match="not sharded over the replica group's 2"):
        shard_across_replica_groups(_prepared(10, 2, False, False, 1, 0), **{**args, "group_size": 2})
    with pytest.raises(ValueError, match="need 0 <= group"):
        shard_across_replica_groups(_prepared(10, 2, False, False, 1, 0), **{**args, "replica_group_id": 2})


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


# -- the scheduler ---------------------------------------------------------------------------------------
class _Skips:
    """Stands for Accelerate's DeepSpeed optimizer wrapper: ``step_was_skipped`` as the test says."""

    step_was_skipped = False


SCHEDULES = {
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10)),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=13),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("groups,gs", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_the_scheduler_steps_as_plain_data_parallelism(schedule, groups, gs, monkeypatch):
    import accelerate.scheduler

    state = GradientState()
    events = [(True, False), (False, False), (True, False), (True, True), (True, False), (False, False),
              (True, False), (True, False)]

    def run(make, processes):
        monkeypatch.setattr(accelerate.scheduler, "AcceleratorState",
                            lambda: SimpleNamespace(num_processes=processes))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        skips = _Skips()
        inner = SCHEDULES[schedule](opt)
        sched = make(inner, skips)
        lrs = []
        for sync, skipped in events:
            state._set_sync_gradients(sync)
            skips.step_was_skipped = skipped
            sched.step()
            lrs.append(sched.get_last_lr()[0])
        return lrs

    try:
        plain = run(AcceleratedScheduler, groups * gs)
        ours = run(lambda s, o: ReplicaGroupsScheduler(s, o, replica_groups=groups), gs)
        per_group = run(AcceleratedScheduler, gs)
    finally:
        state._set_sync_gradients(True)
    assert ours == plain
    assert per_group != plain, "Accelerate's own wrapper in a group steps too slowly (what ftbridge corrects)"


# -- a discard, as Accelerate sees it ----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_world")
def test_a_discarded_step_reads_as_skipped_and_holds_the_learning_rate(monkeypatch):
    import accelerate.optimizer
    import accelerate.scheduler
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    from tests.fakes import gpt_batch
    from tests.test_attach import attached_engine

    monkeypatch.setattr(accelerate.optimizer, "AcceleratorState", lambda: SimpleNamespace(num_processes=1))
    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", lambda: SimpleNamespace(num_processes=1))
    engine = attached_engine(2)
    mark_discarded_steps(engine)
    engine.ftbridge.manager.discard_calls = {2}
    wrapper = DeepSpeedOptimizerWrapper(engine.optimizer)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: (s + 1) / 10)
    sched = ReplicaGroupsScheduler(lambda_lr, wrapper, replica_groups=2)
    GradientState()._set_sync_gradients(True)
    skipped, lrs = [], []
    for i in range(3):
        _, loss = engine(*gpt_batch(i))
        engine.backward(loss)
        engine.step()
        skipped.append(wrapper.step_was_skipped)
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert skipped == [False, True, False]
    assert [engine.ftbridge.last_committed, engine.global_steps] == [True, 2]
    assert lrs == pytest.approx([0.003, 0.003, 0.005]), "held on the discard; two steps (groups) per commit"


# -- slots -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize("members,units", [((0,), 6), ((0, 1, 2), 2)], ids=["alone", "all-live"])
def test_with_slots_accelerates_backward_steps_deepspeed_once_after_the_steps_last_unit(members, units):
    """Group 0 of 3 slots, 2 micro-batches each: alone it computes all 6 units of the step, with every group
    live its own 2. ``accelerator.backward`` (Accelerate's ``DeepSpeedEngineWrapper``) sets DeepSpeed's
    boundary from ``sync_gradients`` and steps when it is true: one optimizer step, after the last unit."""
    import deepspeed
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    import ftbridge
    from ftbridge.config import FTBridgeConfig
    from ftbridge.harness.models import GPTConfig, build_model
    from tests.fakes import TINY_GPT, gpt_batch
    from tests.test_slot_steps import QuorumOf

    model = build_model(GPTConfig(**TINY_GPT), seed=3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000}})
    ftbridge.attach(engine, checksum_every=0, manager_factory=type("Q", (QuorumOf,), {"members": members}),
                    ft_config=FTBridgeConfig.resolve(environ={}, slots=3, num_replica_groups=3, replica_group_id=0))
    state, wrapper = GradientState(), DeepSpeedEngineWrapper(engine)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    seen = []
    for unit in sync_on_the_last_unit(engine.ftbridge.units(), engine, state):
        seen.append(state.sync_gradients)
        _, loss = engine(*gpt_batch(10 * unit.slot + unit.micro))
        wrapper.backward(loss, sync_gradients=state.sync_gradients)
        assert int(engine.global_steps) == int(state.sync_gradients), "DeepSpeed stepped before the last unit"
    assert seen == [False] * (units - 1) + [True]
    assert state.sync_gradients and engine.ftbridge.last_committed
    assert any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


def test_with_slots_accumulate_and_the_loader_shard_are_refused_with_the_fix():
    accelerator = FaultTolerantAccelerator.__new__(FaultTolerantAccelerator)
    accelerator.ft_config, accelerator.ft_engine = SimpleNamespace(slots=2), object()
    with pytest.raises(ValueError, match=r"slots=2: accelerator.units\(\) sets the accumulation boundary"):
        accelerator.accumulate()
    with pytest.raises(ValueError, match=r"UnitSampler.for_engine\(model, len\(dataset\)\)"):
        accelerator.shard_across_replica_groups(object())
    accelerator.ft_engine = None
    with pytest.raises(ValueError, match="prepare the model first"):
        accelerator.units()


def test_units_without_slots_warn_once_that_a_missing_groups_rows_are_not_trained(caplog):
    accelerator = FaultTolerantAccelerator.__new__(FaultTolerantAccelerator)
    cfg = SimpleNamespace(slots=0, group_rank=0, num_replica_groups=2)
    accelerator.ft_config, accelerator.ft_engine = cfg, SimpleNamespace(ftbridge=SimpleNamespace(
        cfg=cfg, units=lambda: iter([])))
    accelerator.__dict__["gradient_state"] = GradientState()
    for _ in range(2):
        assert list(accelerator.units()) == []
    warned = [r.getMessage() for r in caplog.records if "with slots off" in r.getMessage()]
    assert len(warned) == 1 and "FTBRIDGE_SLOTS=2 (ftbridge-run --slots 2)" in warned[0], caplog.text


# -- refusals ----------------------------------------------------------------------------------------------
def _accelerator(**over):
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, parallelism_config=None, mixed_precision="no",
                          split_batches=False, even_batches=True, dispatch_batches=None,
                          state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={}),
                                                deepspeed_plugins=None))
    for k, v in over.items():
        setattr(acc, k, v)
    return acc


@pytest.mark.parametrize("over,match", [
    (dict(split_batches=True), "split_batches=True"),
    (dict(even_batches=False), "even_batches=True"),
    (dict(dispatch_batches=True), "dispatch_batches=True"),
    (dict(mixed_precision="fp8"), "fp8"),
    (dict(parallelism_config=SimpleNamespace(tp_size=1, cp_size=1, sp_size=2)), "sp_size=2"),
    (dict(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
        deepspeed_config={"tensor_parallel": {"autotp_size": 2}}), deepspeed_plugins=None)), "autotp_size"),
    (dict(state=SimpleNamespace(deepspeed_plugin=object(), deepspeed_plugins={"a": 1, "b": 2})), "one deepspeed"),
    (dict(distributed_type="MULTI_CPU"), "deepspeed_plugin=DeepSpeedPlugin"),
])
def test_settings_that_cannot_be_exact_are_refused(over, match):
    assert settings_refusal(_accelerator()) is None
    assert match in (settings_refusal(_accelerator(**over)) or "")


def test_an_unchecked_accelerate_release_is_refused():
    check_accelerate_version("1.15.0")
    with pytest.raises(RuntimeError, match="found 1.16.0"):
        check_accelerate_version("1.16.0")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_rank_world")
def test_a_heal_carries_the_prepared_schedulers_state(monkeypatch):
    """What ``FaultTolerantAccelerator`` registers for a prepared torch scheduler reaches a healing group
    through the heal's wire format, and both then step alike."""
    import accelerate.scheduler

    from ftbridge.manager.transport import decode_state, encode_state
    from tests.fakes import gpt_batch
    from tests.test_attach import attached_engine

    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", lambda: SimpleNamespace(num_processes=1))
    GradientState()._set_sync_gradients(True)
    scheds = []
    for engine in (attached_engine(2), attached_engine(2)):
        inner = torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: min(1.0, (s + 1) / 10))
        sched = ReplicaGroupsScheduler(inner, _Skips(), replica_groups=2)
        engine.ftbridge.register_state("accelerate_scheduler_0", sched.state_dict, sched.load_state_dict)
        scheds.append((engine, sched))
    (donor, donor_sched), (joiner, joiner_sched) = scheds
    for i in range(3):
        _, loss = donor(*gpt_batch(i))
        donor.backward(loss)
        donor.step()
        donor_sched.step()
    assert joiner_sched.get_last_lr() != donor_sched.get_last_lr()
    joiner.ftbridge.load_heal_state(decode_state(encode_state(donor.ftbridge.heal_state())))
    assert joiner_sched.state_dict() == donor_sched.state_dict()
    for _, sched in scheds:
        sched.step()
    assert joiner_sched.get_last_lr() == donor_sched.get_last_lr()
    assert [g["lr"] for g in joiner.optimizer.optimizer.param_groups] == \
        [g["lr"] for g in donor.optimizer.optimizer.param_groups]
