"""Programmatic dependent launch (PDL) of the attention kernels (sm_90 and newer).

The same mechanism and switch as `rlt_models.dependent_launch` (this package cannot import
that one): a kernel launched with the PDL attribute may become resident while the kernel before
it drains, and calls `wait_for_prior_grid` (launch_dependents, then griddepcontrol.wait;
RLT_PDL_TRIGGER=after_wait swaps them) before it touches memory. On where the device supports
it; `RLT_PDL=0` or `set_enabled(False)` turns it off, `set_enabled(None)` returns to the
default.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "RLT_PDL"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MIN_CAPABILITY = 9

_override: bool | None = None


def requested_by_environment() -> bool:
    """RLT_PDL unset or anything but "0" asks for PDL (read once, at import)."""
    return os.environ.get(ENV, "1") != "0"


_environment = requested_by_environment()
TRIGGER_ENV = "RLT_PDL_TRIGGER"
EARLY_TRIGGER = os.environ.get(TRIGGER_ENV, "early") != "after_wait"


def set_enabled(enabled: bool | None) -> None:
    """Force PDL on (where supported) or off for later launches; None: the default."""
    global _override
    _override = enabled


@functools.cache
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= MIN_CAPABILITY


def enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels working on `tensor` are launched with PDL."""
    if INTERPRETED or not tensor.is_cuda:
        return False
    if not (_environment if _override is None else _override):
        return False
    return _device_supports(tensor.get_device())  # an int: cheap on every eager launch


def launch_options(use_pdl: bool) -> dict:
    """Launch keywords for a kernel compiled with USE_PDL=use_pdl (nothing when off)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def _wait_then_trigger():
    tl.inline_asm_elementwise(
        "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _trigger_then_wait():
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.inline_asm_elementwise(
        "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


# What a PDL kernel calls before it touches memory a previous kernel may write: let the next
# kernel's CTAs launch (launch_dependents), then wait (griddepcontrol.wait: the previous kernel
# finished, its writes are visible). Triggering first lets a GEMV two kernels ahead prefetch
# its first weight tile while the kernel before it still runs (on an H200, Ouro-1.4B at one
# row: decode 205.8 vs 200.0 tok/s against triggering after the wait, which
# RLT_PDL_TRIGGER=after_wait restores; read at import). Safe either way: every PDL kernel
# waits before it completes, so a kernel whose predecessor completed also saw everything
# before it complete. Not pure: never removed as dead code.
wait_for_prior_grid = _trigger_then_wait if EARLY_TRIGGER else _wait_then_trigger
