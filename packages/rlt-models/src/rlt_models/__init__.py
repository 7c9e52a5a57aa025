"""rlt-models: the Ouro looped transformer, strict checkpoint loading, and checkpoint writing
and export."""

from rlt_models.checkpoint_export import checkpoint_tensors, save_checkpoint
from rlt_models.checkpoint_writer import RandomInit, random_ouro_tensors, write_random_checkpoint
from rlt_models.config import OuroConfig
from rlt_models.dense_attention import DenseCausalAttention, DenseKVCache
from rlt_models.errors import CheckpointError, ModelConfigError
from rlt_models.loading import build_model, load_model, resolve_dtype
from rlt_models.ouro import OuroModel
from rlt_models.tokenizer import load_tokenizer

__all__ = [
    "CheckpointError",
    "DenseCausalAttention",
    "DenseKVCache",
    "ModelConfigError",
    "OuroConfig",
    "OuroModel",
    "RandomInit",
    "build_model",
    "checkpoint_tensors",
    "load_model",
    "load_tokenizer",
    "random_ouro_tensors",
    "resolve_dtype",
    "save_checkpoint",
    "write_random_checkpoint",
]
