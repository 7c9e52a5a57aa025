"""The projections' kernel choices, measured once and kept between starts in a cache directory.

`small_batch_linear` and `fp8_linear` time their candidates on the device the first time a
(rows bucket, N, K, dtype) shape runs; an engine start measures every decode shape in its
warm-up. `load(directory, device)` fills both selectors from a file written by an earlier
start on the same machine and software, `save(directory, device)` writes what they hold now,
so a later start skips the measurements and picks the same kernels (near-ties no longer go
either way between starts).

The file is `kernel-choices-<fingerprint>.json`. The fingerprint covers what a choice depends
on: the GPU's name and compute capability, the torch and triton versions, whether programmatic
dependent launch is on, and the candidate lists and margins themselves, so a change to any of
them starts a new file and measures again. A file that cannot be read or parsed is ignored
(with a warning) and overwritten by the next save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from rlt_models import fp8_gemv, grid_dependency
from rlt_models import fp8_linear as f8
from rlt_models import small_batch_linear as sbl

logger = logging.getLogger(__name__)

FORMAT = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _indexed(device: torch.device) -> torch.device:
    """The device as a tensor on it reports it (the selectors' keys hold that)."""
    if device.index is None:
        return torch.device(device.type, torch.cuda.current_device())
    return device


def fingerprint(device: torch.device) -> str:
    import triton

    device = _indexed(device)
    properties = torch.cuda.get_device_properties(device)
    probe = torch.empty(0, device=device)
    facts = {
        "format": FORMAT,
        "gpu": properties.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl": grid_dependency.enabled(probe),
        "candidates": repr((sbl.CONFIGS, sbl.MARGIN, f8.FP8_TILES, fp8_gemv.CONFIGS, f8.TOLERANCE)),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cache_file(directory: str | Path, device: torch.device) -> Path:
    return Path(directory) / f"kernel-choices-{fingerprint(device)}.json"


def _tile(fields: dict | None) -> sbl.TileConfig | None:
    return None if fields is None else sbl.TileConfig(**fields)


def load(directory: str | Path, device: torch.device) -> int:
    """Fill the selectors with the choices the cache file holds for `device`; returns how
    many (0 without a usable file). Choices measured in this process are kept."""
    path = cache_file(directory, device)
    if not path.exists():
        return 0
    try:
        entries = json.loads(path.read_text())["choices"]
        device = _indexed(device)
        loaded = {}
        for entry in entries:
            key = (entry["rows"], entry["n"], entry["k"], DTYPES[entry["dtype"]], device)
            if entry["selector"] == "bf16":
                loaded[("bf16", key)] = _tile(entry["tile"])
            else:
                loaded[("fp8", key)] = f8.Fp8Choice(entry["kind"], _tile(entry["tile"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("kernel choices: ignoring %s (%s)", path, error)
        return 0
    for (selector, key), choice in loaded.items():
        choices = sbl.small_batch_linear.choices if selector == "bf16" else f8.fp8_linear.choices
        choices.setdefault(key, choice)
    return len(loaded)


def _held(device: torch.device):
    """(selector, key, choice) of every choice the selectors hold for `device`."""
    for selector, choices in (
        ("bf16", sbl.small_batch_linear.choices),
        ("fp8", f8.fp8_linear.choices),
    ):
        for key, choice in sorted(choices.items(), key=lambda kv: kv[0][:3]):
            if key[4] == device:
                yield selector, key, choice


def count(device: torch.device) -> int:
    """Choices the selectors hold for `device` (measured or loaded)."""
    return sum(1 for _ in _held(_indexed(device)))


def save(directory: str | Path, device: torch.device) -> Path | None:
    """Write every choice the selectors hold for `device` (atomically); None if they hold
    none."""
    device = _indexed(device)
    entries = []
    for selector, (rows, n, k, dtype, _), choice in _held(device):
        entry = {"selector": selector, "rows": rows, "n": n, "k": k}
        entry["dtype"] = str(dtype).removeprefix("torch.")
        if selector == "bf16":
            entry["tile"] = None if choice is None else asdict(choice)
        else:
            entry["kind"] = choice.kind
            entry["tile"] = None if choice.tile is None else asdict(choice.tile)
        entries.append(entry)
    if not entries:
        return None
    path = cache_file(directory, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
        json.dump({"format": FORMAT, "choices": entries}, out, indent=1)
    os.replace(out.name, path)
    return path
