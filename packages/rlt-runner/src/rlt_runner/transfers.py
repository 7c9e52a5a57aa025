"""Host <-> device transfers that never block the host on the device (R21).

Uploads go through page-locked (pinned) host memory with `non_blocking=True`: the copy is queued
on the current stream behind the work already submitted, and torch's pinned-memory allocator keeps
the host buffer alive until that copy has run, so the host moves on at once. Downloads land in
pinned buffers whose contents are valid once an event recorded after the copy has completed.
On the CPU these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor of `values` (a flat or nested list), copied asynchronously."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def download(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of `tensor` into a new pinned host tensor (CUDA) or clone it (CPU). On CUDA
    the result is only valid after the stream reached this point (wait on an event)."""
    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
