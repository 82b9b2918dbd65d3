"""Device and backend choice (ftbridge.device): the decisions, on CPU with the machine passed in."""

from __future__ import annotations

import pytest

from ftbridge import device
from ftbridge.config import FTBridgeConfig
from ftbridge.device import Machine

NO_GPU = Machine(cuda_available=False, visible_gpus=0, physical_gpus=0)
ONE_GPU = Machine(cuda_available=True, visible_gpus=1, physical_gpus=1)
EIGHT_GPUS = Machine(cuda_available=True, visible_gpus=8, physical_gpus=8)


def test_resolve_device_auto_cpu_cuda():
    assert device.resolve_device("auto", NO_GPU, 0) == "cpu"
    assert device.resolve_device("auto", EIGHT_GPUS, 3) == "cuda:3"
    assert device.resolve_device("cpu", EIGHT_GPUS, 3) == "cpu"
    assert device.resolve_device("cuda", ONE_GPU, 0) == "cuda:0"


def test_cuda_asked_without_gpu_fails_with_the_reason():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        device.resolve_device("cuda", NO_GPU, 0)
    with pytest.raises(ValueError, match="local rank 1 has no GPU of its own"):
        device.resolve_device("auto", ONE_GPU, 1)
    with pytest.raises(ValueError, match="not one of"):
        device.resolve_device("gpu", ONE_GPU, 0)


@pytest.mark.parametrize("single_host, groups, local, gpus, shared", [
    (True, 2, 1, 1, True),    # the one-GPU box running 2 groups x 1 rank
    (True, 2, 4, 8, False),   # 8 GPUs, 2 groups of 4: one GPU each
    (True, 3, 4, 8, True),
    (False, 2, 8, 8, False),  # one group per node
])
def test_gpus_shared(single_host, groups, local, gpus, shared):
    assert device.gpus_shared(single_host=single_host, num_replica_groups=groups, local_group_size=local,
                              physical_gpus=gpus) is shared


def test_cross_replica_backend_choice_and_override():
    assert device.cross_replica_backend("auto", on_cuda=False, shared=False) == "gloo"
    assert device.cross_replica_backend("auto", on_cuda=True, shared=False) == "nccl"
    assert device.cross_replica_backend("auto", on_cuda=True, shared=True) == "gloo"
    assert device.cross_replica_backend("gloo", on_cuda=True, shared=False) == "gloo"
    with pytest.raises(ValueError, match="model is on the CPU"):
        device.cross_replica_backend("nccl", on_cuda=False, shared=False)
    with pytest.raises(ValueError, match="share a GPU"):
        device.cross_replica_backend("nccl", on_cuda=True, shared=True)


def test_backend_for_config_one_gpu_two_groups():
    cfg = FTBridgeConfig.resolve({}, num_replica_groups=2)
    assert device.backend_for(cfg, on_cuda=True, machine=ONE_GPU) == "gloo"
    assert device.backend_for(cfg, on_cuda=True, machine=EIGHT_GPUS) == "nccl"
    assert device.backend_for(cfg, on_cuda=False) == "gloo"
    remote = FTBridgeConfig.resolve({}, num_replica_groups=2, heal_bind="10.0.0.5")
    assert device.backend_for(remote, on_cuda=True, machine=ONE_GPU) == "nccl"  # another node per group


def test_config_field_env_and_validation():
    assert FTBridgeConfig.resolve({}).cross_replica_backend == "auto"
    env = {"FTBRIDGE_CROSS_REPLICA_BACKEND": "gloo"}
    assert FTBridgeConfig.resolve(env).cross_replica_backend == "gloo"
    assert FTBridgeConfig.resolve(env, cross_replica_backend="nccl").cross_replica_backend == "nccl"
    with pytest.raises(ValueError, match="cross_replica_backend='mpi'.*FTBRIDGE_CROSS_REPLICA_BACKEND"):
        FTBridgeConfig.resolve({"FTBRIDGE_CROSS_REPLICA_BACKEND": "mpi"})


def test_check_placement():
    cfg = FTBridgeConfig.resolve({}, num_replica_groups=2)
    assert device.check_placement({"cpu"}, "cpu", cfg) == ("cpu", "gloo", "gloo")
    assert device.check_placement({"cpu"}, "cuda", cfg, machine=ONE_GPU, rank_on_node=0) == ("cuda:0", "nccl", "gloo")
    assert device.check_placement({"cuda"}, "cuda", cfg, machine=EIGHT_GPUS, rank_on_node=2) == (
        "cuda:2", "nccl", "nccl")
    with pytest.raises(ValueError, match="DS_ACCELERATOR"):
        device.check_placement({"cuda"}, "cpu", cfg)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        device.check_placement({"cpu"}, "cuda", cfg, machine=NO_GPU, rank_on_node=0)
    nccl = FTBridgeConfig.resolve({}, num_replica_groups=2, cross_replica_backend="nccl")
    with pytest.raises(ValueError, match="model is on the CPU"):
        device.check_placement({"cpu"}, "cpu", nccl)


def test_is_loopback():
    assert device.is_loopback("127.0.0.1") and device.is_loopback("::1") and device.is_loopback("localhost")
    assert not device.is_loopback("10.1.2.3") and not device.is_loopback("node-7")
    assert device.is_loopback("[::1]") and device.is_loopback("LOCALHOST.localdomain")
    assert not device.is_loopback("0.0.0.0")  # every interface, the lighthouse's bind warns about it


def test_train_lm_device_cuda_without_gpu_stops_before_work(monkeypatch, capsys):
    from ftbridge.harness import lm_job

    monkeypatch.setattr(device, "probe", lambda: NO_GPU)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with pytest.raises(SystemExit):
        lm_job.choose_device(["--device", "cuda", "--steps", "3"])
    assert "no CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(device, "probe", lambda: ONE_GPU)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert lm_job.choose_device(["--steps", "3"]) == "cpu"  # auto keeps a preset CPU accelerator (the suite's runs)
    with pytest.raises(SystemExit):
        lm_job.choose_device(["--device", "cuda"])
    assert "DS_ACCELERATOR=cpu" in capsys.readouterr().err
    monkeypatch.delenv("DS_ACCELERATOR")
    assert lm_job.choose_device([]) == "cuda:0"
    import os
    assert os.environ["DS_ACCELERATOR"] == "cuda"
