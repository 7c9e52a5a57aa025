"""This package's side of PDL follows the one switch (rlt_contracts.dependent_launch, tested
there): never for CPU tensors, on for CUDA tensors of sm_90+ devices while the switch asks, and
`wait_for_prior_grid` compiles to the switch's two instructions in its order. (That PDL launches
compute the same tokens is checked on CUDA by tests/test_cuda_engine.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from rlt_contracts import dependent_launch
from rlt_models import grid_dependency


@pytest.fixture(autouse=True)
def default_switch(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    yield
    dependent_launch.set_enabled(None)


class CudaTensor:
    """A stand-in for a CUDA tensor on device 1 (get_device() is the device index)."""

    is_cuda = True

    @staticmethod
    def get_device():
        return 1


def test_never_for_cpu_tensors():
    dependent_launch.set_enabled(True)
    assert not grid_dependency.enabled(torch.zeros(1))


def test_cuda_tensors_of_capable_devices_while_the_switch_asks(monkeypatch):
    seen = []
    monkeypatch.setattr(grid_dependency, "_device_supports", lambda i: seen.append(i) or i == 1)
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert grid_dependency.enabled(CudaTensor())
    dependent_launch.set_enabled(False)  # the one switch, shared with rlt-attention
    assert not grid_dependency.enabled(CudaTensor())
    dependent_launch.set_enabled(None)
    monkeypatch.setattr(dependent_launch, "_environment", False)  # RLT_PDL=0
    assert not grid_dependency.enabled(CudaTensor())
    monkeypatch.setattr(dependent_launch, "INTERPRETED", True)
    dependent_launch.set_enabled(True)
    assert not grid_dependency.enabled(CudaTensor())
    assert seen == [1]  # the device is asked only when the switch is on
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    monkeypatch.setattr(grid_dependency, "_device_supports", lambda i: False)
    assert not grid_dependency.enabled(CudaTensor())


PROBE = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlt_models.grid_dependency import wait_for_prior_grid


@triton.jit
def probe(out_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        wait_for_prior_grid()
    tl.store(out_ptr, 1.0)


for use_pdl in (False, True):
    source = ASTSource(probe, {"out_ptr": "*fp32", "USE_PDL": "constexpr"}, {"USE_PDL": use_pdl})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(use_pdl, [line.split(";")[0].strip() for line in ptx.splitlines() if "griddep" in line])
"""


@pytest.mark.slow  # a fresh interpreter and two sm_90 compilations: ~7 s on a 2-core CPU
def test_wait_for_prior_grid_compiles_to_the_switch_instructions(tmp_path):
    """Compiled for sm_90 without a GPU (the interpreter never runs the PDL branch): off, no
    griddepcontrol instruction; on, the switch's two, in its order."""
    pytest.importorskip("triton.backends.nvidia")
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, check=True
    ).stdout
    expected = [i.split(";")[0] for i in dependent_launch.GRID_DEPENDENCY_INSTRUCTIONS]
    assert out.splitlines() == ["False []", f"True {expected}"]


@pytest.mark.cuda
def test_on_this_device(monkeypatch):
    x = torch.zeros(1, device="cuda")
    hopper = dependent_launch.supports(torch.cuda.get_device_capability()[0])
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert grid_dependency.enabled(x) == hopper
    dependent_launch.set_enabled(False)
    assert not grid_dependency.enabled(x)
