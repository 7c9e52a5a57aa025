"""Programmatic dependent launch (PDL) of the decode loop's Triton kernels (sm_90 and newer).

At batch 1 a loop is ~280 kernels back to back, each only a few microseconds long, and every
boundary costs a launch gap plus a ramp (the next kernel's CTAs start only once the last CTA of
the previous one has finished). A kernel launched with the PDL attribute may instead become
resident while its predecessor drains; it executes `griddepcontrol.wait` (the prior grid has
completed and its writes are visible) before it reads or writes anything the predecessor may
touch, and `griddepcontrol.launch_dependents` (by default just before the wait), so its own
successor can become resident early too. The weight-streaming GEMVs load their first weight tile
before the wait: weights never change while the engine runs, so those loads overlap the
kernels still running ahead of them.

Every kernel that is launched with the attribute must take `USE_PDL` and, when it is set, call
`wait_for_prior_grid` before touching memory a previous kernel may write (otherwise it would
race); `launch_options(enabled)` gives the launch keyword to pass together with `USE_PDL=enabled`.
A kernel without the attribute (cuBLAS, torch ops) waits for its predecessor as usual, so PDL
kernels mix freely with others in one stream or CUDA graph.

On by default where the device supports it (compute capability >= 9, compiled Triton, not the
interpreter). `RLT_PDL=0` in the environment (read at import), or `set_enabled(False)`, turns
it off (A/B measurements); `set_enabled(None)` returns to the default.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - linux wheels of torch bring triton
    triton = None

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
    """Force PDL on (where supported) or off for later launches; None: the default (module
    doc). Graphs captured earlier keep the launches they recorded."""
    global _override
    _override = enabled


@functools.cache
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= MIN_CAPABILITY


def enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels working on `tensor` are launched with PDL."""
    if triton is None or INTERPRETED or not tensor.is_cuda:
        return False
    if not (_environment if _override is None else _override):
        return False
    return _device_supports(tensor.get_device())  # an int: cheap on every eager launch


def launch_options(use_pdl: bool) -> dict:
    """Launch keywords for a kernel compiled with USE_PDL=use_pdl (nothing when off, so the
    interpreter and older launchers never see the keyword)."""
    return {"launch_pdl": True} if use_pdl else {}


if triton is not None:

    @triton.jit
    def _wait_then_trigger():
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0",
            "=r",
            [],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _trigger_then_wait():
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0",
            "=r",
            [],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
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
