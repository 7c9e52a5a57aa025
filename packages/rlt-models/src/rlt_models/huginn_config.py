"""Huginn-0125's config.json (`RavenForCausalLM`, model_type `huginn_raven`) and its declaration
(model-families.md section 4; the model and its checkpoint layout are `huginn.py`).

The authors' `RavenConfig` saves every attribute, derived ones included (`padded_vocab_size`,
`num_key_value_heads`, `head_dim`, `effective_expected_depth`, `init_values`, ...), beside the
fields it is built from. What the authors' model reads decides the meaning here:
- the embedding and the head have `padded_vocab_size` rows (`vocab_size` when absent): that is
  the logits' width, `HuginnConfig.vocab_size`;
- the embedding is scaled by `init_values["embed_scale"]` (sqrt(n_embd) when absent);
- attention has `n_heads` heads of n_embd / n_heads, keys and values as many (a config whose
  `num_key_value_heads` or `head_dim` says otherwise is refused: the authors' q/k bias could
  not broadcast over fewer key heads);
- training-only settings (`init_strategy`, `sampling_scheme`, `mean_backprop_depth`, ...) are
  ignored; module choices (`block_class_name`, `injection_type`, ...) must hold the release's
  value and test-time noise must be off, or loading fails naming the key.

Initial state (`state_init`): the release's "like-init" (a random draw per token: huginn.py's
module doc; the declaration's `random_initial_state`) or "zero"; other kinds are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from rlt_contracts import (
    ExitSignal,
    FamilyDeclaration,
    Feature,
    KVPlan,
    LoopedModelShape,
    StagePlan,
)

from rlt_models.config_fields import check_keys, eos_ids, require_fields, torch_dtype_name
from rlt_models.errors import ModelConfigError

MODEL_TYPE = "huginn_raven"
ARCHITECTURE = "RavenForCausalLM"
STATE_INITS = ("like-init", "zero")  # "like-init" is served with the zero state for now
# The authors' `generate` stops at begin_text, end_text and end_turn whatever the config says.
AUTHOR_STOP_IDS = (65504, 65505, 65508)
STAGES = ("prelude", "core_block", "coda")

# Training-only settings (ignored), with the release's values (`to_dict` writes them).
_TRAINING_SETTINGS = {
    "activation_checkpoint_impl": "per-iteration",
    "init_orthogonal": False,
    "init_strategy": "takase",
    "mean_backprop_depth": 8,
    "padding_multiple": 4096,
    "sampling_scheme": "poisson-lognormal-filling",
}
_IGNORED_KEYS = (
    *_TRAINING_SETTINGS,
    "test_time_noise_type",  # read only with test_time_noise > 0 (refused)
    # derived by the authors' config (checked or read below)
    "n_layers",
    "effective_expected_depth",
    "num_key_value_heads",
    "head_dim",
    "padded_vocab_size",
    "init_values",
    "tie_word_embeddings",
)
# The release's modules: any other value is a model rlt does not implement.
_NEUTRAL = {
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "bias": False,
    "test_time_noise": 0,
}
_UNSUPPORTED = (
    (Feature.SHARED_KV, "the shared layout's prompts run position by position, which does not "
     "run the prelude's and coda's layers"),
    (Feature.SPECULATIVE_DECODING, "a draft's positions would need the prelude's and coda's KV"),
    (Feature.EXIT_DEPTH_SCORING, "prompt scoring at exit depth is not built for stage families"),
    (Feature.FP8_WEIGHTS, "not verified for this family yet"),
)  # fmt: skip


@dataclass(frozen=True)
class HuginnConfig:
    vocab_size: int = 65536  # rows of the embedding and the head (the authors' padded size)
    n_embd: int = 5280
    n_heads: int = 55
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    intermediate_size: int = 17920
    mean_recurrence: int = 32
    block_size: int = 4096
    rope_base: float = 50_000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    tie_embeddings: bool = True
    state_init: str = "like-init"
    embed_scale: float | None = None  # init_values["embed_scale"]; None: sqrt(n_embd)
    eos_token_id: tuple[int, ...] = (65505,)
    torch_dtype: str = "bfloat16"
    # the engine's loop cap in recurrent steps (loop_cap.py; never in config.json); None:
    # twice mean_recurrence
    max_model_loops: int | None = None

    def __post_init__(self) -> None:
        require_fields(
            self,
            ("vocab_size", "n_embd", "n_heads", "n_layers_in_recurrent_block",
             "intermediate_size", "mean_recurrence", "block_size"),
        )  # fmt: skip
        require_fields(self, ("n_layers_in_prelude", "n_layers_in_coda"), minimum=0)
        if self.n_embd % self.n_heads or (self.n_embd // self.n_heads) % 2:
            raise ModelConfigError(
                ("n_embd", "n_heads"),
                f"n_embd {self.n_embd} must split into n_heads {self.n_heads} heads of an even "
                "width (pair-wise RoPE)",
            )
        if self.state_init not in STATE_INITS:
            raise ModelConfigError(
                "state_init",
                f"{ARCHITECTURE}: rlt implements {STATE_INITS}, got {self.state_init!r}",
            )
        if self.embed_scale is not None and not self.embed_scale > 0:
            raise ModelConfigError(
                "init_values", f"embed_scale must be > 0, got {self.embed_scale}"
            )
        outside = [e for e in self.eos_token_id if e >= self.vocab_size]
        if outside:
            raise ModelConfigError(
                "eos_token_id", f"{outside} outside the vocabulary of {self.vocab_size}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        check_keys(
            raw, cls, model_type=MODEL_TYPE, architecture=ARCHITECTURE, ignored=_IGNORED_KEYS,
            neutral=_NEUTRAL, not_read=("embed_scale",),
        )  # fmt: skip
        n_embd, n_heads = raw.get("n_embd", 5280), raw.get("n_heads", 55)
        if isinstance(n_embd, int) and isinstance(n_heads, int) and n_heads > 0:
            for key, derived in (("num_key_value_heads", n_heads), ("head_dim", n_embd // n_heads)):
                if raw.get(key, derived) != derived:
                    raise ModelConfigError(
                        key,
                        f"{ARCHITECTURE} attends with n_heads {n_heads} heads of n_embd / n_heads "
                        f"= {n_embd // n_heads} for queries, keys and values; config.json says "
                        f"{key} {raw[key]!r}",
                    )
        tie = raw.get("tie_embeddings", raw.get("tie_word_embeddings", True))
        if "tie_word_embeddings" in raw and bool(raw["tie_word_embeddings"]) != bool(tie):
            raise ModelConfigError(
                ("tie_embeddings", "tie_word_embeddings"), "disagree on tying the head"
            )
        vocab = raw.get("vocab_size", 65536)
        padded = raw.get("padded_vocab_size") or vocab
        if isinstance(vocab, int) and isinstance(padded, int) and padded < vocab:
            raise ModelConfigError("padded_vocab_size", f"{padded} is below vocab_size {vocab}")
        return cls(
            vocab_size=padded,
            n_embd=n_embd,
            n_heads=n_heads,
            n_layers_in_prelude=raw.get("n_layers_in_prelude", 2),
            n_layers_in_recurrent_block=raw.get("n_layers_in_recurrent_block", 4),
            n_layers_in_coda=raw.get("n_layers_in_coda", 2),
            intermediate_size=raw.get("intermediate_size", 17920),
            mean_recurrence=raw.get("mean_recurrence", 32),
            block_size=raw.get("block_size", 4096),
            rope_base=float(raw.get("rope_base", 50_000.0)),
            norm_eps=float(raw.get("norm_eps", 1e-6)),
            qk_bias=bool(raw.get("qk_bias", True)),
            tie_embeddings=bool(tie),
            state_init=raw.get("state_init", "like-init"),
            embed_scale=_embed_scale(raw.get("init_values")),
            eos_token_id=eos_ids({"eos_token_id": _or(raw.get("eos_token_id"), 65505)}),
            torch_dtype=torch_dtype_name(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json as the authors' `RavenConfig` saves it (derived keys included), which
        `from_dict` reads back as this config (with `embed_scale` explicit)."""
        d, depth = self.n_embd, self.effective_expected_depth
        std = math.sqrt(2 / (5 * d))
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **_NEUTRAL,
            **_TRAINING_SETTINGS,
            "test_time_noise_type": "fixed",
            "block_size": self.block_size,
            "effective_expected_depth": depth,
            "eos_token_id": list(self.eos_token_id),
            "head_dim": self.head_dim,
            "init_values": {
                "std": std,
                "out_proj": std / math.sqrt(2 * depth),
                "embedding": std,
                "embed_scale": self.scale,
            },
            "intermediate_size": self.intermediate_size,
            "mean_recurrence": self.mean_recurrence,
            "n_embd": d,
            "n_heads": self.n_heads,
            "n_layers": self.n_layers_in_prelude
            + self.n_layers_in_recurrent_block
            + self.n_layers_in_coda,
            "n_layers_in_coda": self.n_layers_in_coda,
            "n_layers_in_prelude": self.n_layers_in_prelude,
            "n_layers_in_recurrent_block": self.n_layers_in_recurrent_block,
            "norm_eps": self.norm_eps,
            "num_key_value_heads": self.n_heads,
            "padded_vocab_size": self.vocab_size,
            "qk_bias": self.qk_bias,
            "rope_base": self.rope_base,
            "state_init": self.state_init,
            "tie_embeddings": self.tie_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.torch_dtype,
            "vocab_size": self.vocab_size,
        }

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def hidden_size(self) -> int:  # LoopedModelBase's name
        return self.n_embd

    @property
    def max_position_embeddings(self) -> int:
        return self.block_size

    @property
    def rope_theta(self) -> float:  # LoopedModelBase's split-half rotary (unused here)
        return self.rope_base

    @property
    def scale(self) -> float:
        """The embedding's scale."""
        return self.embed_scale if self.embed_scale is not None else math.sqrt(self.n_embd)

    @property
    def effective_expected_depth(self) -> int:
        return (
            self.n_layers_in_prelude
            + self.n_layers_in_coda
            + self.n_layers_in_recurrent_block * self.mean_recurrence
        )

    @property
    def stage_layers(self) -> int:
        return self.n_layers_in_prelude + self.n_layers_in_coda

    @property
    def model_depth(self) -> int:
        """Recurrent steps the engine is sized for: its cap, by default 2 x mean_recurrence."""
        return self.max_model_loops or 2 * self.mean_recurrence

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """config.json's eos ids, then the authors' fixed stops that lie in the vocabulary."""
        extra = [t for t in AUTHOR_STOP_IDS if t < self.vocab_size and t not in self.eos_token_id]
        return (*self.eos_token_id, *extra)

    def tied_tensors(self) -> dict[str, str]:
        return {"lm_head.weight": "transformer.wte.weight"} if self.tie_embeddings else {}

    def derived_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint may store that config.json defines: the RoPE table."""
        cos, sin = rope_table(self.head_dim, self.rope_base, self.block_size, torch.device("cpu"))
        return {"freqs_cis": torch.stack([cos, sin], dim=-1)[None, :, None]}

    def shape(self) -> LoopedModelShape:
        return LoopedModelShape(
            # one block holds a plane's slots: the core layers', or the stage plane's
            num_layers=max(self.n_layers_in_recurrent_block, self.stage_layers),
            num_loops=self.model_depth,
            hidden_size=self.n_embd,
            num_heads=self.n_heads,
            num_kv_heads=self.n_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.block_size,
            eos_token_ids=self.stop_token_ids,
            state_size=2 * self.n_embd,
        )

    def declaration(self) -> FamilyDeclaration:
        return FamilyDeclaration(
            name="huginn",
            architecture=ARCHITECTURE,
            stages=StagePlan(
                core_layers=self.n_layers_in_recurrent_block,
                prelude_layers=self.n_layers_in_prelude,
                coda_layers=self.n_layers_in_coda,
            ),
            state=("state", "prelude_output"),
            loop_input="adapter(cat[state, prelude output]) (a linear map of both)",
            kv=KVPlan(
                layers_per_plane=max(self.n_layers_in_recurrent_block, self.stage_layers),
                stage_layers=self.stage_layers,
            ),
            exit_signal=ExitSignal.LATENT_CHANGE,
            default_loops=self.mean_recurrence,
            max_loops=self.model_depth,
            loop_limit=None,  # more steps of the same block are computable: any cap
            unsupported=_UNSUPPORTED,
            random_initial_state=self.state_init == "like-init",
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _embed_scale(init_values: Any) -> float | None:
    if init_values is None:
        return None
    if not isinstance(init_values, dict):
        raise ModelConfigError("init_values", f"must be a mapping, got {init_values!r}")
    scale = init_values.get("embed_scale")
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ModelConfigError("init_values", f"embed_scale must be a number, got {scale!r}")
    return float(scale)


def rope_table(
    head_dim: int, base: float, positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim / 2] fp32 of the pair-wise RoPE, computed as the authors'
    `precompute_freqs_cis` does (fp32 frequencies, fp32 angles position x frequency)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()
