"""Fixtures of the rlt-models tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def faithful_bf16(monkeypatch):
    """Make Triton's interpreter round fp32 -> bf16 to nearest even, as GPUs do (it truncates
    otherwise); nothing to do on CUDA."""
    import numpy as np
    import torch

    if torch.cuda.is_available():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        pytest.skip("this Triton's interpreter has no _convert_float to make bf16-faithful")

    def round_to_nearest_even(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", round_to_nearest_even)
