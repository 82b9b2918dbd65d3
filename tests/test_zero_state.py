"""Unit tests for ftbridge.zero.state: pickle-free optimizer state on the wire, rebuilt on the joiner."""

import collections
import enum

import pytest
import torch

from ftbridge.manager.transport import decode_state, encode_state
from ftbridge.zero.state import from_wire, to_wire


def over_the_wire(obj):
    """What a joiner really receives: to_wire, the transport's encoding, decoding."""
    return decode_state(encode_state(to_wire(obj)))


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def train_steps(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=gen)).pow(2).mean().backward()
        opt.step()


def assert_optimizer_states_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert set(sa["state"]) == set(sb["state"])
    for idx in sa["state"]:
        assert set(sa["state"][idx]) == set(sb["state"][idx])
        for key, value in sa["state"][idx].items():
            torch.testing.assert_close(sb["state"][idx][key], value, rtol=0, atol=0)


# -- real torch optimizers ------------------------------------------------------

def test_adamw_state_after_steps_is_restored_exactly():
    donor_model = make_model(0)
    donor = torch.optim.AdamW(donor_model.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    train_steps(donor_model, donor, 3)

    joiner_model = make_model(0)
    joiner = torch.optim.AdamW(joiner_model.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    train_steps(joiner_model, joiner, 1, seed=99)  # a different history that the heal must overwrite

    merged = from_wire(joiner.state_dict(), over_the_wire(donor.state_dict()))
    joiner.load_state_dict(merged)
    assert_optimizer_states_equal(donor, joiner)


def test_adamw_before_first_step_is_filled_from_peer_with_int_keys():
    donor_model = make_model(1)
    donor = torch.optim.AdamW(donor_model.parameters(), lr=0.01)
    train_steps(donor_model, donor, 2)

    joiner_model = make_model(1)
    joiner_model.load_state_dict(donor_model.state_dict())
    joiner = torch.optim.AdamW(joiner_model.parameters(), lr=0.01)
    local = joiner.state_dict()
    assert local["state"] == {}  # lazily created at the first step

    merged = from_wire(local, over_the_wire(donor.state_dict()))
    n_params = len(list(joiner_model.parameters()))
    assert set(merged["state"]) == set(range(n_params))
    assert all(type(k) is int for k in merged["state"])

    joiner.load_state_dict(merged)
    # The moments really are restored in the optimizer, keyed by the parameter objects.
    for p_donor, p_joiner in zip(donor_model.parameters(), joiner_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(joiner.state[p_joiner][key], donor.state[p_donor][key], rtol=0, atol=0)

    # And the next step is the same on both: the heal is complete.
    train_steps(donor_model, donor, 1, seed=5)
    train_steps(joiner_model, joiner, 1, seed=5)
    for p_donor, p_joiner in zip(donor_model.parameters(), joiner_model.parameters()):
        torch.testing.assert_close(p_joiner, p_donor, rtol=0, atol=0)
    assert_optimizer_states_equal(donor, joiner)


def test_param_group_structure_keeps_tuples_lists_and_scalar_types():
    model = make_model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.85, 0.99), foreach=None)
    local = opt.state_dict()
    merged = from_wire(local, over_the_wire(local))
    group = merged["param_groups"][0]
    assert type(merged["param_groups"]) is list
    assert type(group["betas"]) is tuple and group["betas"] == (0.85, 0.99)
    assert type(group["params"]) is list and group["params"] == local["param_groups"][0]["params"]
    assert group["foreach"] is None and group["amsgrad"] is False and group["lr"] == 0.02


def test_peer_scalars_win_over_local_scalars():
    local = {"lr": 0.1, "step": 3, "name": "a", "flag": False, "betas": (0.9, 0.999)}
    peer = {"lr": 0.5, "step": 10, "name": "b", "flag": True, "betas": (0.5, 0.6)}
    assert from_wire(local, over_the_wire(peer)) == peer


def test_multiple_param_groups_and_sgd_momentum():
    model = make_model(3)
    groups = [{"params": list(model[0].parameters()), "lr": 0.1},
              {"params": list(model[2].parameters()), "lr": 0.01, "momentum": 0.5}]
    donor = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    train_steps(model, donor, 2)

    model2 = make_model(3)
    joiner = torch.optim.SGD([{"params": list(model2[0].parameters()), "lr": 0.1},
                              {"params": list(model2[2].parameters()), "lr": 0.01, "momentum": 0.5}],
                             lr=0.1, momentum=0.9)
    joiner.load_state_dict(from_wire(joiner.state_dict(), over_the_wire(donor.state_dict())))
    assert_optimizer_states_equal(donor, joiner)


# -- tensors: dtype, device, shape ------------------------------------------------

def test_tensor_is_cast_to_the_local_dtype():
    local = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    peer = {"w": torch.tensor([1.0, 2.0, 3.5])}
    out = from_wire(local, over_the_wire(peer))
    assert out["w"].dtype == torch.bfloat16
    assert torch.equal(out["w"], torch.tensor([1.0, 2.0, 3.5], dtype=torch.bfloat16))


def test_shape_mismatch_names_both_shapes_and_the_path():
    local = {"state": {0: {"exp_avg": torch.zeros(4, 3)}}}
    peer = {"state": {0: {"exp_avg": torch.zeros(2, 3)}}}
    with pytest.raises(ValueError) as err:
        from_wire(local, over_the_wire(peer))
    msg = str(err.value)
    assert "(2, 3)" in msg and "(4, 3)" in msg
    assert "/state/0/exp_avg" in msg


def test_zero_dim_versus_one_element_is_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"peer shape \(1,\) != local shape \(\)"):
        from_wire({"step": torch.tensor(1.0)}, over_the_wire({"step": torch.tensor([1.0])}))


def test_scalar_where_a_tensor_is_expected_is_refused():
    with pytest.raises(ValueError, match="expected a tensor, got float"):
        from_wire({"step": torch.tensor(1.0)}, {"step": 1.0})


# -- missing keys -------------------------------------------------------------

def test_key_missing_in_peer_state_names_the_key():
    local = {"state": {}, "param_groups": [{"lr": 0.1}], "extra": 1}
    peer = {"state": {}, "param_groups": [{"lr": 0.1}]}
    with pytest.raises(ValueError) as err:
        from_wire(local, over_the_wire(peer))
    assert "'extra'" in str(err.value) and "<root>" in str(err.value)


def test_optimizer_state_missing_in_peer_is_refused():
    # The joiner has stepped, the peer has not: the peer cannot supply the joiner's moments.
    model = make_model(4)
    stepped = torch.optim.AdamW(model.parameters())
    train_steps(model, stepped, 1)
    fresh = torch.optim.AdamW(make_model(4).parameters())
    with pytest.raises(ValueError, match="lacks"):
        from_wire(stepped.state_dict(), over_the_wire(fresh.state_dict()))


def test_list_element_missing_in_peer_is_refused():
    with pytest.raises(ValueError, match=r"lacks \['1'\]"):
        from_wire({"groups": [{"lr": 1.0}, {"lr": 2.0}]}, over_the_wire({"groups": [{"lr": 1.0}]}))


def test_mapping_expected_but_peer_sent_a_leaf():
    with pytest.raises(ValueError, match="expected a mapping"):
        from_wire({"groups": [1, 2]}, {"groups": 5})


# -- enums, loss scalers, other objects ---------------------------------------------

class Stage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2


class Mode(enum.Enum):
    fast = "fast"
    slow = "slow"


class Opaque(enum.Enum):
    thing = (1, 2)  # a non-scalar value: cannot be sent


def test_enum_leaf_is_sent_as_value_and_rebuilt_as_enum():
    wire = over_the_wire({"zero_stage": Stage.gradients, "mode": Mode.slow})
    assert wire == {"zero_stage": 2, "mode": "slow"}
    out = from_wire({"zero_stage": Stage.disabled, "mode": Mode.fast}, wire)
    assert out["zero_stage"] is Stage.gradients and out["mode"] is Mode.slow


def test_enum_with_unsendable_value_stays_local():
    assert to_wire({"o": Opaque.thing, "x": 1}) == {"x": 1}
    out = from_wire({"o": Opaque.thing, "x": 0}, over_the_wire({"o": Opaque.thing, "x": 1}))
    assert out == {"o": Opaque.thing, "x": 1}


class FakeLossScaler:
    """Shaped like DeepSpeed's DynamicLossScaler."""

    def __init__(self, cur_scale, cur_iter, last_overflow_iter=-1):
        self.cur_scale = cur_scale
        self.cur_iter = cur_iter
        self.last_overflow_iter = last_overflow_iter
        self.dynamic = True
        self.cur_hysteresis = 2
        self.dtype = torch.float16          # not a JSON scalar: stays local
        self.history = [1, 2]               # not a JSON scalar: stays local


def test_loss_scaler_scalar_attributes_are_set_on_the_local_object():
    local_scaler = FakeLossScaler(cur_scale=65536.0, cur_iter=0)
    donor_scaler = FakeLossScaler(cur_scale=1024.0, cur_iter=77, last_overflow_iter=60)
    donor_scaler.cur_hysteresis = 1
    donor_scaler.dtype = torch.bfloat16
    donor_scaler.history = [9]

    wire = over_the_wire({"loss_scaler": donor_scaler, "overflow": False})
    assert wire["loss_scaler"] == {"__attrs__": {"cur_scale": 1024.0, "cur_iter": 77, "last_overflow_iter": 60,
                                                 "dynamic": True, "cur_hysteresis": 1}}
    out = from_wire({"loss_scaler": local_scaler, "overflow": True}, wire)
    assert out["loss_scaler"] is local_scaler  # updated in place, not replaced
    assert (local_scaler.cur_scale, local_scaler.cur_iter, local_scaler.last_overflow_iter) == (1024.0, 77, 60)
    assert local_scaler.cur_hysteresis == 1
    assert local_scaler.dtype is torch.float16 and local_scaler.history == [1, 2]
    assert out["overflow"] is False


def test_real_deepspeed_loss_scaler_and_zero_stage_enum():
    ds_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    ds_zero = pytest.importorskip("deepspeed.runtime.zero.config")

    def scaler(scale):
        return ds_scaler.DynamicLossScaler(init_scale=scale, scale_window=1000, min_scale=1,
                                           delayed_shift=2, consecutive_hysteresis=False)

    donor = scaler(2.0 ** 10)
    donor.cur_iter, donor.last_overflow_iter, donor.cur_hysteresis = 500, 480, 1
    local = scaler(2.0 ** 16)
    state = {"loss_scaler": donor, "zero_stage": ds_zero.ZeroStageEnum.gradients, "dynamic_loss_scale": True,
             "partition": [torch.arange(4.0)]}
    out = from_wire({"loss_scaler": local, "zero_stage": ds_zero.ZeroStageEnum.optimizer_states,
                     "dynamic_loss_scale": True, "partition": [torch.zeros(4)]}, over_the_wire(state))
    assert out["loss_scaler"] is local
    assert (local.cur_scale, local.cur_iter, local.last_overflow_iter, local.cur_hysteresis) == (1024.0, 500, 480, 1)
    assert local.dtype == donor.dtype
    assert out["zero_stage"] is ds_zero.ZeroStageEnum.gradients
    assert type(out["partition"]) is list and torch.equal(out["partition"][0], torch.arange(4.0))


class Address:
    """A non-scaler object (like DeepSpeed's fragment_address): never sent, kept local."""

    def __init__(self, numel):
        self.numel = numel


def test_other_objects_are_dropped_on_send_and_kept_local():
    local_addr = Address(10)
    assert to_wire({"addr": Address(3), "keep": None}) == {"keep": None}
    out = from_wire({"addr": local_addr, "keep": None, "x": torch.zeros(1)},
                    over_the_wire({"addr": Address(3), "keep": None, "x": torch.ones(1)}))
    assert out["addr"] is local_addr and out["keep"] is None and torch.equal(out["x"], torch.ones(1))


# -- containers ------------------------------------------------------------------

def test_tuples_lists_namedtuples_and_ordered_dicts_keep_their_type():
    Point = collections.namedtuple("Point", "x y")
    local = {
        "betas": (0.9, 0.999),
        "params": [0, 1, 2],
        "nested": [(torch.zeros(2), 1), [torch.zeros(1)]],
        "point": Point(0, 0),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
    }
    peer = {
        "betas": (0.5, 0.6),
        "params": [3, 4, 5],
        "nested": [(torch.ones(2), 7), [torch.full((1,), 2.0)]],
        "point": Point(3, 4),
        "ordered": collections.OrderedDict([("b", 10), ("a", 20)]),
    }
    out = from_wire(local, over_the_wire(peer))
    assert type(out["betas"]) is tuple and out["betas"] == (0.5, 0.6)
    assert type(out["params"]) is list and out["params"] == [3, 4, 5]
    assert type(out["nested"]) is list and type(out["nested"][0]) is tuple and type(out["nested"][1]) is list
    assert torch.equal(out["nested"][0][0], torch.ones(2)) and out["nested"][0][1] == 7
    assert torch.equal(out["nested"][1][0], torch.full((1,), 2.0))
    assert type(out["point"]) is Point and out["point"] == Point(3, 4)
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"].items()) == [("b", 10), ("a", 20)]


def test_to_wire_output_is_transport_safe():
    model = make_model(6)
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt, 1)
    state = {"optimizer": opt.state_dict(), "stage": Stage.gradients, "scaler": FakeLossScaler(8.0, 1),
             "addr": Address(1)}
    wire = to_wire(state)

    def check(node):
        if isinstance(node, dict):
            assert all(type(k) is str for k in node)
            for v in node.values():
                check(v)
        else:
            assert isinstance(node, (torch.Tensor, bool, int, float, str, type(None))), type(node)

    check(wire)
    assert wire["optimizer"]["param_groups"]["0"]["betas"] == {"0": 0.9, "1": 0.999}
    encode_state(wire)  # does not raise


def test_from_wire_does_not_mutate_the_local_dict():
    local = {"state": {}, "lr": 0.1}
    before = {"state": {}, "lr": 0.1}
    from_wire(local, over_the_wire({"state": {"0": {"x": torch.ones(1)}}, "lr": 0.5}))
    assert local == before
