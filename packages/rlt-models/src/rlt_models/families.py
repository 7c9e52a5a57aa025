"""The family registry: config.json's `architectures` picks the family that loads a checkpoint.

Each entry names the family's config parser (`from_dict`, with `shape()` and `declaration()`),
its model class, and its checkpoint layout (tensor names and shapes; the runtime parameter each
is fused into). Adding a family is a module and one line here; nothing outside rlt-models names
a family (tests/test_dependency_rules.py).

`hf_overrides` (vLLM's name) are applied to config.json's mapping before the family reads it,
so e.g. `{"num_loops": 1}` changes what the family declares and the engine sizes; then the
engine's loop cap `max_model_loops` sets the model depth (loop_cap.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlt_models import config as ouro_config
from rlt_models import dory_config, hrm_text, huginn, huginn_config, nanbeige, weights
from rlt_models.config_fields import read_raw_config
from rlt_models.dory import DoryModel
from rlt_models.dory_config import DoryConfig
from rlt_models.errors import ModelConfigError
from rlt_models.hrm_text import HrmTextConfig, HrmTextModel
from rlt_models.huginn_config import HuginnConfig
from rlt_models.loop_cap import apply_loop_cap
from rlt_models.nanbeige import NanbeigeConfig, NanbeigeModel
from rlt_models.ouro import OuroModel


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    config: type  # from_dict(raw) -> config with shape() and declaration()
    model: type  # model(config): a LoopedLanguageModel with empty parameters
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    parameter_sources: Callable[[Any], dict[str, tuple[str, ...]]]
    # the checkpoint may carry per-layer fp8 KV scales under Llama's names (kv_scales.py)
    llama_kv_scales: bool = True
    # a stored tensor name in the family's canonical (transformers') layout, for checkpoints
    # published under other names (None: names are canonical already)
    canonical_name: Callable[[str], str] | None = None


FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family(
            ouro_config.ARCHITECTURE,
            ouro_config.MODEL_TYPE,
            ouro_config.OuroConfig,
            OuroModel,
            weights.checkpoint_tensor_shapes,
            weights.parameter_sources,
        ),
        Family(
            nanbeige.ARCHITECTURE,
            nanbeige.MODEL_TYPE,
            NanbeigeConfig,
            NanbeigeModel,
            nanbeige.checkpoint_tensor_shapes,
            nanbeige.parameter_sources,
        ),
        Family(
            hrm_text.ARCHITECTURE,
            hrm_text.MODEL_TYPE,
            HrmTextConfig,
            HrmTextModel,
            hrm_text.checkpoint_tensor_shapes,
            hrm_text.parameter_sources,
            llama_kv_scales=False,
        ),
        Family(
            dory_config.ARCHITECTURE,
            dory_config.MODEL_TYPE,
            DoryConfig,
            DoryModel,
            dory_config.checkpoint_tensor_shapes,
            dory_config.parameter_sources,
            llama_kv_scales=False,
            canonical_name=dory_config.hub_tensor_name,
        ),
        Family(
            huginn_config.ARCHITECTURE,
            huginn_config.MODEL_TYPE,
            HuginnConfig,
            huginn.HuginnModel,
            huginn.checkpoint_tensor_shapes,
            huginn.parameter_sources,
            llama_kv_scales=False,
        ),
    )
}


def family_for(raw: Mapping[str, Any]) -> Family:
    """The family config.json names: its first `architectures` entry rlt knows, or (for a
    config without `architectures`) its `model_type`."""
    if not isinstance(raw, Mapping):
        raise ModelConfigError("config.json", "must hold a JSON object")
    names = raw.get("architectures")
    if names is None:
        by_type = {f.model_type: f for f in FAMILIES.values()}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
        names = []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ModelConfigError("architectures", f"must be a list of names, got {names!r}")
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise ModelConfigError(
        "architectures",
        f"{names or raw.get('model_type')!r} is not a looped family rlt serves; supported: "
        f"{', '.join(FAMILIES)}",
    )


def family_of(config: Any) -> Family:
    """The registered family of a parsed config."""
    for family in FAMILIES.values():
        if type(config) is family.config:
            return family
    raise TypeError(f"{type(config).__name__} is not a registered family's config")


def parse_config(
    raw: Mapping[str, Any],
    hf_overrides: Mapping[str, Any] | None = None,
    max_model_loops: int | None = None,
):
    """The family's parsed config of a config.json mapping, after `hf_overrides`, sized for
    the engine's loop cap `max_model_loops` (None: the family's default cap; loop_cap.py)."""
    if hf_overrides:
        if not isinstance(hf_overrides, Mapping):
            raise ModelConfigError("hf_overrides", "must be a JSON object of config keys")
        raw = {**raw, **hf_overrides}
    return apply_loop_cap(family_for(raw).config.from_dict(dict(raw)), max_model_loops)


def read_config(
    model_dir: str | Path,
    hf_overrides: Mapping[str, Any] | None = None,
    max_model_loops: int | None = None,
):
    """Parse `model_dir`'s config.json as its family's config (after `hf_overrides`, under
    the loop cap `max_model_loops`)."""
    return parse_config(read_raw_config(model_dir), hf_overrides, max_model_loops)
