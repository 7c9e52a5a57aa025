"""Checks every family's config parser shares: each failure is a `ModelConfigError` naming the
field, so a checkpoint rlt cannot run exactly is never loaded silently."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlt_models.errors import ModelConfigError

TORCH_DTYPES = ("bfloat16", "float16", "float32")
# Keys transformers writes into every config.json that do not change a model's computation
# (metadata, generation ids, output switches); each family adds its own to what it accepts.
HF_METADATA_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "bos_token_id",
        "pad_token_id",
        "eos_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def require_model_type(raw: Any, expected: str) -> None:
    if not isinstance(raw, dict):
        raise ModelConfigError("config.json", "must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type != expected:
        raise ModelConfigError("model_type", f"expected {expected!r}, got {model_type!r}")


def require_fields(config: Any, names: Iterable[str]) -> None:
    """Each named attribute of `config` is a positive integer."""
    missing = [name for name in names if getattr(config, name) is None]
    if missing:
        raise ModelConfigError(tuple(missing), "required field(s) missing")
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(name, f"must be a positive integer, got {value!r}")


def disabled(value: Any) -> bool:
    """A feature switch at its off value (false, null, 0 or empty)."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def reject_enabled(
    raw: Mapping[str, Any], neutral: Mapping[str, Any], known: Iterable[str], *, family: str
) -> None:
    """Options in `neutral` must hold that value; a key that is neither known nor neutral is
    accepted only while `disabled` (a feature rlt does not implement, switched off)."""
    for key, value in neutral.items():
        if key in raw and raw[key] != value and not (value is None and disabled(raw[key])):
            raise ModelConfigError(key, f"{family}: only {value!r} is supported, got {raw[key]!r}")
    known = set(known) | set(neutral)
    enabled = sorted(k for k, v in raw.items() if k not in known and not disabled(v))
    if enabled:
        raise ModelConfigError(
            tuple(enabled),
            f"{family}: option(s) rlt does not implement are enabled; it cannot run this "
            "checkpoint exactly",
        )


def eos_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", 0)
    ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not ids or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in ids):
        raise ModelConfigError("eos_token_id", f"must be a token id or a list of ids, got {eos!r}")
    return ids


def torch_dtype_name(raw: Mapping[str, Any]) -> str:
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    if name not in TORCH_DTYPES:
        raise ModelConfigError("torch_dtype", f"unsupported dtype {name!r}")
    return name


def read_raw_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of `model_dir` as a mapping (a missing or malformed file names itself)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError("config.json", f"not found in {model_dir}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError("config.json", f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError("config.json", f"{path} must hold a JSON object")
    return raw
