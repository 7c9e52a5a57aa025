"""rlt-models: the looped model families (Ouro, Nanbeige4.2), their registry, strict checkpoint
loading, and checkpoint writing and export."""

from rlt_models.checkpoint_export import checkpoint_tensors, save_checkpoint
from rlt_models.checkpoint_writer import (
    RandomInit,
    random_checkpoint_tensors,
    random_ouro_tensors,
    write_random_checkpoint,
)
from rlt_models.config import OuroConfig
from rlt_models.dense_attention import DenseCausalAttention, DenseKVCache
from rlt_models.errors import CheckpointError, ModelConfigError
from rlt_models.families import (
    FAMILIES,
    family_for,
    parse_config,
    read_config,
)
from rlt_models.hrm_text import HrmTextConfig, HrmTextModel
from rlt_models.loading import build_model, load_model, resolve_dtype
from rlt_models.looped_model import LoopedModelBase
from rlt_models.nanbeige import NanbeigeConfig, NanbeigeModel
from rlt_models.ouro import OuroModel
from rlt_models.tokenizer import load_tokenizer

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "DenseCausalAttention",
    "DenseKVCache",
    "HrmTextConfig",
    "HrmTextModel",
    "LoopedModelBase",
    "ModelConfigError",
    "NanbeigeConfig",
    "NanbeigeModel",
    "OuroConfig",
    "OuroModel",
    "RandomInit",
    "build_model",
    "family_for",
    "parse_config",
    "random_checkpoint_tensors",
    "read_config",
    "checkpoint_tensors",
    "load_model",
    "load_tokenizer",
    "random_ouro_tensors",
    "resolve_dtype",
    "save_checkpoint",
    "write_random_checkpoint",
]
