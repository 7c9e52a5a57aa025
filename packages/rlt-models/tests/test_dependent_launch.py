"""The PDL switch: off wherever it cannot apply, on by default on sm_90+, RLT_PDL=0 (read at
import) and `set_enabled` turn it off. (That PDL launches compute the same tokens is checked on
CUDA by tests/test_cuda_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from rlt_models import dependent_launch


@pytest.fixture(autouse=True)
def default_switch():
    yield
    dependent_launch.set_enabled(None)


def test_never_for_cpu_tensors():
    dependent_launch.set_enabled(True)
    assert not dependent_launch.enabled(torch.zeros(1))
    assert dependent_launch.launch_options(False) == {}
    assert dependent_launch.launch_options(True) == {"launch_pdl": True}


def test_environment_switch(monkeypatch):
    monkeypatch.delenv(dependent_launch.ENV, raising=False)
    assert dependent_launch.requested_by_environment()
    monkeypatch.setenv(dependent_launch.ENV, "0")
    assert not dependent_launch.requested_by_environment()
    monkeypatch.setenv(dependent_launch.ENV, "1")
    assert dependent_launch.requested_by_environment()


def test_on_cuda_tensors_of_capable_devices_only(monkeypatch):
    """The CUDA branch without a GPU: a stand-in tensor on device 1 (get_device() is the
    device index), with device 1 capable or not."""

    class CudaTensor:
        is_cuda = True

        @staticmethod
        def get_device():
            return 1

    seen = []
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    monkeypatch.setattr(dependent_launch, "_device_supports", lambda i: seen.append(i) or i == 1)
    dependent_launch.set_enabled(None)
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert dependent_launch.enabled(CudaTensor())
    monkeypatch.setattr(dependent_launch, "_device_supports", lambda i: False)
    assert not dependent_launch.enabled(CudaTensor())
    monkeypatch.setattr(dependent_launch, "_environment", False)  # RLT_PDL=0
    assert not dependent_launch.enabled(CudaTensor())
    assert seen == [1]


@pytest.mark.cuda
def test_default_follows_the_device_and_the_environment(monkeypatch):
    x = torch.zeros(1, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= dependent_launch.MIN_CAPABILITY
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert dependent_launch.enabled(x) == hopper
    monkeypatch.setattr(dependent_launch, "_environment", False)  # RLT_PDL=0 at import
    assert not dependent_launch.enabled(x)
    dependent_launch.set_enabled(True)  # the override wins over the environment
    assert dependent_launch.enabled(x) == hopper
    monkeypatch.setattr(dependent_launch, "_environment", True)
    dependent_launch.set_enabled(False)
    assert not dependent_launch.enabled(x)
