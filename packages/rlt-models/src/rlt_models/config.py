"""`OuroConfig`: the Ouro model configuration parsed strictly from a Hugging Face config.json.

Only the fields the architecture uses are kept. Known metadata keys are accepted and ignored;
unknown keys and unsupported features (sliding window, rope scaling, attention bias, tied
embeddings, non-SiLU activations) are errors naming the field, so a checkpoint we cannot run
exactly is never loaded silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlt_contracts import ExitSignal, FamilyDeclaration, KVPlan, LoopedModelShape, StagePlan

from rlt_models.config_fields import (
    HF_METADATA_KEYS,
    TORCH_DTYPES,
    attention_heads,
    check_heads,
    eos_ids,
    llama_shape,
    read_raw_config,
    require_fields,
    require_model_type,
)
from rlt_models.errors import ModelConfigError

MODEL_TYPE = "ouro"
ARCHITECTURE = "OuroForCausalLM"

# Keys a real Ouro / Qwen2-derived config carries that do not change the computation.
_IGNORED_KEYS = HF_METADATA_KEYS | frozenset(
    {
        "initializer_range",
        "max_window_layers",
        "chunk_size",
        "attention_dropout",
    }
)


@dataclass(frozen=True)
class OuroConfig:
    """Architecture of an Ouro model (field names follow config.json).

    hidden_size d, num_hidden_layers L (physical layers, shared by all loops), total_ut_steps T
    (loops), num_attention_heads H, num_key_value_heads Hkv, head_dim D, intermediate_size (MLP).
    early_exit_threshold is the checkpoint's default exit threshold (informational: the engine
    takes the threshold per request).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    total_ut_steps: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    eos_token_id: tuple[int, ...] = (0,)
    early_exit_threshold: float = 1.0
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        require_fields(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
             "max_position_embeddings"),
        )  # fmt: skip
        check_heads(self)
        if not self.rms_norm_eps > 0:
            raise ModelConfigError("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ModelConfigError("rope_theta", f"must be > 0, got {self.rope_theta}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ModelConfigError("torch_dtype", f"unsupported dtype {self.torch_dtype!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        """Parse a config.json mapping; raise `ModelConfigError` naming any bad field."""
        require_model_type(raw, MODEL_TYPE)
        _reject_unsupported(raw)
        known = (
            {f for f in cls.__dataclass_fields__}
            | _IGNORED_KEYS
            | _CHECKED_KEYS
            | {"quantization_config"}  # rlt_models.fp8_checkpoint
        )
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ModelConfigError(
                tuple(unknown),
                "unknown config field(s); rlt cannot tell whether they change the model",
            )
        missing = [name for name in _REQUIRED if name not in raw]
        if missing:
            raise ModelConfigError(tuple(missing), "required field(s) missing")
        heads, kv_heads, head_dim = attention_heads(raw)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            total_ut_steps=raw.get("total_ut_steps", 4),
            max_position_embeddings=raw["max_position_embeddings"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
            eos_token_id=eos_ids(raw),
            early_exit_threshold=float(raw.get("early_exit_threshold", 1.0)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        )

    @classmethod
    def ouro_1_4b(cls) -> OuroConfig:
        """The architecture of ByteDance/Ouro-1.4B (ouro-model-spec.md section 1)."""
        return cls(
            vocab_size=49152,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            total_ut_steps=4,
            max_position_embeddings=65536,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> OuroConfig:
        return cls.from_dict(read_raw_config(model_dir))

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face style config.json mapping that `from_dict` reads back identically."""
        fields = asdict(self)
        fields["eos_token_id"] = (
            list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0]
        )
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **fields,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_scaling": None,
            "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "bos_token_id": self.eos_token_id[0],
            "pad_token_id": self.eos_token_id[0],
            "early_exit_step": None,
        }

    def shape(self) -> LoopedModelShape:
        return llama_shape(self, self.num_hidden_layers, self.total_ut_steps)

    def tied_tensors(self) -> dict[str, str]:
        """Ouro's head is untied: no tensor may be left out."""
        return {}

    def declaration(self) -> FamilyDeclaration:
        """Ouro as a looped family: one stack of L layers applied T times, a learned gate."""
        return FamilyDeclaration(
            name=MODEL_TYPE,
            architecture=ARCHITECTURE,
            stages=StagePlan(core_layers=self.num_hidden_layers),
            state=("hidden",),
            loop_input="the previous loop's output after the end-of-loop norm",
            kv=KVPlan(layers_per_plane=self.num_hidden_layers),
            exit_signal=ExitSignal.GATE,
            default_loops=self.total_ut_steps,
            max_loops=self.total_ut_steps,
            # the hazard rule's last loop takes the exit mass left at T: the gate was trained
            # for T loops, so no engine cap runs deeper (loop_cap.py)
            loop_limit=self.total_ut_steps,
        )

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 4 * d
        return self.num_hidden_layers * per_layer + 2 * v * d + d + d + 1


# Fields config.json must hold (the others have defaults or are derived).
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
# Keys checked by `_reject_unsupported` (accepted only at their neutral value).
_CHECKED_KEYS = frozenset(
    {
        "hidden_act",
        "tie_word_embeddings",
        "use_sliding_window",
        "sliding_window",
        "rope_scaling",
        "attention_bias",
        "layer_types",
        "early_exit_step",
        "num_key_value_heads",
        "head_dim",
        "eos_token_id",
    }
)


def _reject_unsupported(raw: dict[str, Any]) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
    if raw.get("tie_word_embeddings", False):
        raise ModelConfigError(
            "tie_word_embeddings", "Ouro has an untied lm_head; tied embeddings are unsupported"
        )
    if raw.get("use_sliding_window", False) or raw.get("sliding_window") is not None:
        raise ModelConfigError(
            ("use_sliding_window", "sliding_window"), "sliding-window attention is not supported"
        )
    if raw.get("rope_scaling") is not None:
        raise ModelConfigError(
            "rope_scaling", f"only default RoPE is supported, got {raw['rope_scaling']!r}"
        )
    if raw.get("attention_bias", False):
        raise ModelConfigError("attention_bias", "Ouro projections have no bias")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise ModelConfigError("layer_types", "every layer must be 'full_attention'")
    if raw.get("early_exit_step") is not None:
        raise ModelConfigError(
            "early_exit_step", "a fixed exit step is not supported; use max_loops per request"
        )
