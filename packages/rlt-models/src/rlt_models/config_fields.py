"""What every family's config shares: checks whose failure is a `ModelConfigError` naming the
field, so a checkpoint rlt cannot run exactly is never loaded silently, and the engine's shape of
a config with Llama's field names."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from rlt_contracts import LoopedModelShape

from rlt_models.errors import ModelConfigError
from rlt_models.loop_cap import ENGINE_FIELD

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


def check_keys(
    raw: Mapping[str, Any],
    config_class: type,
    *,
    model_type: str,
    architecture: str,
    ignored: Iterable[str],
    neutral: Mapping[str, Any],
    not_read: Iterable[str] = (),
) -> None:
    """config.json names the family's `model_type`, and each key is a field of `config_class`
    (less the engine's loop cap and `not_read`), metadata, `ignored`, or an option of `neutral`
    at its value (`reject_enabled`)."""
    require_model_type(raw, model_type)
    names = {f.name for f in fields(config_class)} - {ENGINE_FIELD, *not_read}
    reject_enabled(raw, neutral, names | HF_METADATA_KEYS | set(ignored), family=architecture)


def require_fields(config: Any, names: Iterable[str], *, minimum: int = 1) -> None:
    """Each named attribute of `config` is an integer >= `minimum` (a positive one by default;
    None: missing)."""
    missing = [name for name in names if getattr(config, name) is None]
    if missing:
        raise ModelConfigError(tuple(missing), "required field(s) missing")
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ModelConfigError(name, f"must be {what}, got {value!r}")


def check_heads(config: Any) -> None:
    """Query heads a multiple of the key/value heads (GQA), an even head_dim (RoPE)."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelConfigError(
            ("num_attention_heads", "num_key_value_heads"),
            "attention heads must be a multiple of key/value heads",
        )
    if config.head_dim % 2:
        raise ModelConfigError("head_dim", f"RoPE needs an even head_dim, got {config.head_dim}")


def attention_heads(raw: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(heads, key/value heads, head_dim) of a Llama-style config.json: the key/value heads
    default to the heads, head_dim to hidden_size / heads (0 where that cannot be computed)."""
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    derived = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    return heads, raw.get("num_key_value_heads") or heads, raw.get("head_dim") or derived


def tied_head(tied: bool, embedding: str = "model.embed_tokens.weight") -> dict[str, str]:
    """`tied_tensors()` of a family whose head may be tied to its embedding."""
    return {"lm_head.weight": embedding} if tied else {}


def llama_shape(
    config: Any, num_layers: int, num_loops: int, *, num_kv_heads: int = 0, state_size: int = 0
) -> LoopedModelShape:
    """The engine's shape of a config with Llama's field names (its key/value heads
    `num_key_value_heads` unless `num_kv_heads` says)."""
    return LoopedModelShape(
        num_layers=num_layers,
        num_loops=num_loops,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads or config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_ids=config.eos_token_id,
        state_size=state_size,
    )


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
