"""Programmatic dependent launch (PDL): the one switch every rlt Triton kernel reads.

A kernel launched with the PDL attribute (sm_90 and newer) may become resident while its
predecessor drains (at batch 1 a decode loop is ~280 kernels back to back). Both kernel
packages (rlt-models, rlt-attention) launch so; neither may import the other, so their shared
switch lives here (README.md, `dependent_launch`). A PDL kernel takes `USE_PDL: tl.constexpr`
and, when set, executes `GRID_DEPENDENCY_INSTRUCTIONS` before it touches memory a previous
kernel may write (only weight loads may come earlier), and is launched with
`launch_options(use_pdl)`. On by default (`RLT_PDL`, read at import; `set_enabled` overrides
it), never under the Triton interpreter; graphs captured earlier keep what they recorded.
"""

from __future__ import annotations

import os

ENV = "RLT_PDL"
TRIGGER_ENV = "RLT_PDL_TRIGGER"
MIN_CAPABILITY = 9  # compute capability major: Hopper (sm_90) and newer
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_by_environment() -> bool:
    """RLT_PDL unset or anything but "0" asks for PDL (read once, at import)."""
    return os.environ.get(ENV, "1") != "0"


_environment = requested_by_environment()
_override: bool | None = None

# Triggering before the wait lets a GEMV two kernels ahead prefetch its first weight tile while
# the kernel before it still runs (on an H200, Ouro-1.4B at one row: decode 205.8 vs 200.0
# tok/s against triggering after the wait, which RLT_PDL_TRIGGER=after_wait restores; read at
# import). Safe either way: every PDL kernel waits before it completes, so a kernel whose
# predecessor completed also saw everything before it complete.
TRIGGER_BEFORE_WAIT = os.environ.get(TRIGGER_ENV, "early") != "after_wait"
LAUNCH_DEPENDENTS = "griddepcontrol.launch_dependents; // $0"
WAIT = "griddepcontrol.wait; // $0"
GRID_DEPENDENCY_INSTRUCTIONS = (
    (LAUNCH_DEPENDENTS, WAIT) if TRIGGER_BEFORE_WAIT else (WAIT, LAUNCH_DEPENDENTS)
)


def set_enabled(enabled: bool | None) -> None:
    """Force PDL on (where the device supports it) or off for later launches of every rlt
    kernel; None: the environment's choice (module doc)."""
    global _override
    _override = enabled


def requested() -> bool:
    """Whether kernels should be launched with PDL where the device supports it: the override,
    else the environment; never under the Triton interpreter."""
    if INTERPRETED:
        return False
    return _environment if _override is None else _override


def supports(capability_major: int) -> bool:
    """Whether a device of this compute capability major can take PDL launches."""
    return capability_major >= MIN_CAPABILITY


def launch_options(use_pdl: bool) -> dict:
    """Launch keywords for a kernel compiled with USE_PDL=use_pdl (nothing when off, so the
    interpreter and older launchers never see the keyword)."""
    return {"launch_pdl": True} if use_pdl else {}
