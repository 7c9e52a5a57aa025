"""The attention kernels' side of PDL reads the one switch (rlt_contracts.dependent_launch, the
same as rlt-models' kernels; tested there): CUDA tensors of sm_90+ devices only, off with
`set_enabled(False)` or RLT_PDL=0; and the store kernel, compiled for sm_90, carries the switch's
instructions exactly when USE_PDL is set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rlt_contracts import dependent_launch

grid_dependency = pytest.importorskip("rlt_attention.grid_dependency")


@pytest.fixture(autouse=True)
def default_switch(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    yield
    dependent_launch.set_enabled(None)


def test_follows_the_switch_on_capable_devices_only(monkeypatch):
    class CudaTensor:  # a stand-in: get_device() is the device index
        is_cuda = True

        @staticmethod
        def get_device():
            return 0

    capable = {0: True}
    monkeypatch.setattr(grid_dependency, "_device_supports", lambda i: capable[i])
    monkeypatch.setattr(dependent_launch, "_environment", True)
    dependent_launch.set_enabled(True)
    assert not grid_dependency.enabled(torch.zeros(1))
    assert grid_dependency.enabled(CudaTensor())
    capable[0] = False
    assert not grid_dependency.enabled(CudaTensor())
    capable[0] = True
    dependent_launch.set_enabled(False)
    assert not grid_dependency.enabled(CudaTensor())
    dependent_launch.set_enabled(None)
    monkeypatch.setattr(dependent_launch, "_environment", False)  # RLT_PDL=0 at import
    assert not grid_dependency.enabled(CudaTensor())


STORE_KERNEL_PTX = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlt_attention.triton_kernel import _store_kv_kernel

names = _store_kv_kernel.arg_names
constexprs = {"HEAD_DIM": 128, "BLOCK_H": 16, "BLOCK_D": 128, "KV_FP8": False}
pointer = {"write_slots_ptr": "*i64", "key_scale_ptr": "*fp32", "value_scale_ptr": "*fp32"}
signature = {
    n: "constexpr" if n in constexprs or n == "USE_PDL"
    else pointer.get(n, "*bf16") if n.endswith("_ptr") else "i32"
    for n in names
}
for use_pdl in (False, True):
    source = ASTSource(_store_kv_kernel, signature, {**constexprs, "USE_PDL": use_pdl})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(use_pdl, [line.split(";")[0].strip() for line in ptx.splitlines() if "griddep" in line])
"""


@pytest.mark.slow  # a fresh interpreter and two sm_90 compilations: ~8 s on a 2-core CPU
def test_store_kernel_compiles_to_the_switch_instructions():
    """Compiled without a GPU (the interpreter never runs the PDL branch)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", STORE_KERNEL_PTX], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    expected = [i.split(";")[0] for i in dependent_launch.GRID_DEPENDENCY_INSTRUCTIONS]
    assert out.stdout.splitlines() == ["False []", f"True {expected}"]


@pytest.mark.cuda
def test_on_this_device(monkeypatch):
    x = torch.zeros(1, device="cuda")
    hopper = dependent_launch.supports(torch.cuda.get_device_capability()[0])
    monkeypatch.setattr(dependent_launch, "_environment", True)
    assert grid_dependency.enabled(x) == hopper
    dependent_launch.set_enabled(False)
    assert not grid_dependency.enabled(x)
