"""Write a random-initialised checkpoint directory of any registered family (Ouro,
Nanbeige, ...) in the real Hugging Face layout.

The directory holds config.json, model.safetensors (or shards + model.safetensors.index.json),
and a byte-level BPE tokenizer trained offline (tokenizer.json, tokenizer_config.json with the
eos/pad tokens and a ChatML template, special_tokens_map.json). Tests use it for tiny models;
benchmarks use it for Ouro-1.4B-shaped models.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlt_models.config import OuroConfig
from rlt_models.families import family_of
from rlt_models.loading import DTYPES
from rlt_models.safetensors_files import INDEX_FILE, SINGLE_FILE
from rlt_models.sample_text import SAMPLE_TEXT
from rlt_models.tokenizer import MIN_VOCAB_SIZE, save_hf_tokenizer, train_byte_level_bpe

MAX_TOKENIZER_VOCAB = 4096


@dataclass(frozen=True)
class RandomInit:
    """Distribution of the random weights.

    weight_std: std of every projection and embedding (normal, mean 0).
    norm_jitter: RMSNorm weights are 1 + jitter * normal(0, 1) (non-unit weights make tests
      sensitive to a misplaced norm).
    gate_std / gate_bias: exit-gate weight std and bias; with a unit-RMS normed state the gate
      logit has std about gate_std * sqrt(hidden_size).
    weight_std_by_prefix: ((tensor name prefix, std), ...): the std of the projections whose
      names start with a prefix (the first that matches) instead of weight_std, e.g. a smaller
      one for Huginn's recurrent block so its steps converge; the noise drawn is the same.
    """

    weight_std: float = 0.02
    norm_jitter: float = 0.1
    gate_std: float = 0.05
    gate_bias: float = 0.0
    weight_std_by_prefix: tuple[tuple[str, float], ...] = ()


def random_ouro_tensors(
    config: OuroConfig, *, seed: int, init: RandomInit = RandomInit(), device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor (fp32, on `device`), reproducible from `seed`."""
    return random_checkpoint_tensors(config, seed=seed, init=init, device=device)


def random_checkpoint_tensors(
    config, *, seed: int, init: RandomInit = RandomInit(), device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint of `config`'s family (fp32, on `device`), reproducible
    from `seed`: norms near 1, the exit gate (if any) as `init` says, the rest normal."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in family_of(config).tensor_shapes(config).items():
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if _is_norm_weight(name):
            tensors[name] = 1.0 + init.norm_jitter * noise
        elif name == "model.early_exit_gate.weight":
            tensors[name] = init.gate_std * noise
        elif name == "model.early_exit_gate.bias":
            tensors[name] = torch.full(shape, init.gate_bias, device=device)
        else:
            stds = (std for prefix, std in init.weight_std_by_prefix if name.startswith(prefix))
            tensors[name] = next(stds, init.weight_std) * noise
    return tensors


def _is_norm_weight(name: str) -> bool:
    """An RMSNorm's weight: Llama's `*norm.weight` / `*layernorm*`, Huginn's `norm_1..4` and
    `ln_f` (module names that hold "norm" or start with "ln_")."""
    module, _, leaf = name.rpartition(".")
    owner = module.rpartition(".")[2]
    return leaf == "weight" and ("norm" in owner or owner.startswith("ln_"))


def write_random_checkpoint(
    out_dir: str | Path,
    config,
    *,
    seed: int = 0,
    dtype: str = "float32",
    init: RandomInit = RandomInit(),
    max_shard_bytes: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write a complete random checkpoint directory and return its path.

    dtype: storage dtype of the weights ("float32", "bfloat16", "float16"); also written as the
      config's torch_dtype. max_shard_bytes: if set, split into shards with an index file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if config.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} to hold a byte-level tokenizer")
    config = dataclasses.replace(config, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    random = random_checkpoint_tensors(config, seed=seed, init=init, device=device)
    # tensors config.json defines that the family's checkpoints store too (Huginn's RoPE table)
    derived = getattr(config, "derived_tensors", None)
    random.update(derived() if derived is not None else {})
    tensors = {name: tensor.to(DTYPES[dtype]).cpu().contiguous() for name, tensor in random.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        _write_shards(out, tensors, max_shard_bytes)
    tokenizer = train_byte_level_bpe(
        SAMPLE_TEXT.splitlines(), vocab_size=min(config.vocab_size, MAX_TOKENIZER_VOCAB)
    )
    save_hf_tokenizer(tokenizer, out, model_max_length=config.max_position_embeddings)
    return out


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
