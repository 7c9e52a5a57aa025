"""This package's side of programmatic dependent launch (PDL): whether a tensor's device takes
PDL launches (`enabled`) and the Triton helper its kernels call (`wait_for_prior_grid`), the
parts that need torch or Triton. The switch, the instructions, the launch keyword and the
contract a PDL kernel follows are `rlt_contracts.dependent_launch`'s, shared with rlt-models
(README.md, "Where PDL lives").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from rlt_contracts import dependent_launch


@functools.cache
def _device_supports(device_index: int) -> bool:
    return dependent_launch.supports(torch.cuda.get_device_capability(device_index)[0])


def enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels working on `tensor` are launched with PDL."""
    if not tensor.is_cuda or not dependent_launch.requested():
        return False
    return _device_supports(tensor.get_device())  # an int: cheap on every eager launch


_FIRST: tl.constexpr = tl.constexpr(dependent_launch.GRID_DEPENDENCY_INSTRUCTIONS[0])
_SECOND: tl.constexpr = tl.constexpr(dependent_launch.GRID_DEPENDENCY_INSTRUCTIONS[1])


@triton.jit
def wait_for_prior_grid():
    """launch_dependents and griddepcontrol.wait, in the switch's order. Not pure: never removed
    as dead code."""
    tl.inline_asm_elementwise(_FIRST, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise(_SECOND, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
