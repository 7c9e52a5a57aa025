"""The seeded workload the engine benchmarks replay: random checkpoints of named shapes,
random prompts, and the decode phase of a step log.

Shapes (`--shape`): tiny (Ouro), ouro-1.4b (`OuroConfig.ouro_1_4b()`), nanbeige4.2-3b (the
Nanbeige4.2-3B release's architecture), hrm-text-1b, dory-4b (the Dory1.0-4B release's),
huginn-3.5b (Huginn-0125's: 32 steps by default, the engine's cap is 64), each with a tiny-
variant for CPU smoke tests. A shape's checkpoint is written once (bf16 random weights, gate
std 0.05, seed 0) under the checkpoint folder, generated on the GPU when the device is one.
huginn-3.5b's recurrent block (core layers, adapter) has std 0.002: at 0.02 its random
recurrence is chaotic (latent change ||s_k - s_{k-1}|| / ||s_k|| near sqrt(2) at every step:
no `latent_diff` exit), at 0.002 it shrinks about 0.7x a step (fp32, release width: below
0.03 after 12-13 steps), so live exits happen; speed does not depend on the values.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

MIX = (0.55, 0.40, 0.05)  # depths 2 / 3 / 4: the 2.5-loop mix ("mix 2.5")
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4)
_TINY_LAYERS = dict(_TINY, head_dim=16, max_position_embeddings=2048)
SHAPES = {  # name: (rlt_models config class, its fields; None: the class's release preset)
    "tiny": (
        "OuroConfig",
        dict(_TINY_LAYERS, num_hidden_layers=2, num_key_value_heads=4, total_ut_steps=4),
    ),
    "ouro-1.4b": ("OuroConfig", None),
    # 22 Llama layers x 2 loops, GQA 48 / 8 heads of 128, rope theta 7e7, 256K positions
    "nanbeige4.2-3b": (
        "NanbeigeConfig",
        dict(
            vocab_size=166144,
            hidden_size=3072,
            intermediate_size=10752,
            num_hidden_layers=22,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            num_loops=2,
            max_position_embeddings=262144,
            rope_theta=70_000_000.0,
        ),
    ),
    "tiny-nanbeige": (
        "NanbeigeConfig",
        dict(_TINY_LAYERS, num_hidden_layers=2, num_key_value_heads=2, num_loops=2),
    ),
    # L and H stacks of 16 layers, H_cycles 2 x (L_cycles 3 + 1), 12 heads of 128, prefix-LM
    "hrm-text-1b": (
        "HrmTextConfig",
        dict(
            vocab_size=65536,
            hidden_size=1536,
            intermediate_size=4096,
            num_layers_per_stack=16,
            num_attention_heads=12,
            head_dim=128,
            H_cycles=2,
            L_cycles=3,
            max_position_embeddings=4096,
            embedding_scale=39.19,
        ),
    ),
    "tiny-hrm-text": (
        "HrmTextConfig",
        dict(_TINY_LAYERS, num_layers_per_stack=2, H_cycles=2, L_cycles=2, embedding_scale=10.0),
    ),
    # 8 prelude + 20 recurrent + 8 coda nGPT layers, 2 loops, 16 / 4 heads of 256, sliding
    # window 1024 on three layers in four
    "dory-4b": (
        "DoryConfig",
        dict(
            vocab_size=131072,
            hidden_size=2560,
            intermediate_size=7168,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            n_input_layers=8,
            n_recurrent_layers=20,
            n_output_layers=8,
            n_recurrent_loops=2,
            max_position_embeddings=8192,
            layer_types=tuple(
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(36)
            ),
        ),
    ),
    "tiny-dory": (
        "DoryConfig",
        dict(
            _TINY_LAYERS,
            num_key_value_heads=2,
            n_input_layers=1,
            n_recurrent_layers=2,
            n_output_layers=1,
            n_recurrent_loops=2,
            sliding_window=32,
            layer_types=("sliding_attention",) * 2 + ("full_attention", "sliding_attention"),
        ),
    ),
    # 2 prelude + 4 recurrent + 2 coda sandwich blocks, 55 heads of 96, mean_recurrence 32:
    # HuginnConfig's defaults
    "huginn-3.5b": ("HuginnConfig", {}),
    "tiny-huginn": (
        "HuginnConfig",
        dict(
            vocab_size=512,
            n_embd=64,
            n_heads=4,
            n_layers_in_prelude=1,
            n_layers_in_recurrent_block=2,
            n_layers_in_coda=1,
            intermediate_size=128,
            mean_recurrence=4,
            block_size=2048,
            eos_token_id=(0,),
        ),
    ),
}
SHAPE_NAMES = tuple(SHAPES)
CONVERGENT = (("transformer.core_block.", 0.002), ("transformer.adapter.", 0.002))
INIT_STD_BY_PREFIX = {"huginn-3.5b": CONVERGENT}  # shape: RandomInit.weight_std_by_prefix


def shape_config(name: str):
    """The model config of a --shape name (any family)."""
    import rlt_models
    from rlt_models.dory_config import DoryConfig
    from rlt_models.huginn_config import HuginnConfig

    kind, fields = SHAPES[name]
    cls = {"DoryConfig": DoryConfig, "HuginnConfig": HuginnConfig}.get(kind)
    cls = cls or getattr(rlt_models, kind)
    return cls.ouro_1_4b() if fields is None else cls(**fields)


def ensure_checkpoint(
    shape: str, checkpoint_dir: str | Path, device: str = "cpu", model: str | None = None
) -> Path:
    """`model` if given, else the random checkpoint of `shape`, written if missing."""
    if model:
        return Path(model)
    from rlt_models import RandomInit, write_random_checkpoint
    from rlt_models.families import family_of

    path = Path(checkpoint_dir) / shape
    if not (path / "config.json").exists():
        config = shape_config(shape)
        params = sum(math.prod(s) for s in family_of(config).tensor_shapes(config).values())
        on = "cuda" if str(device).startswith("cuda") else "cpu"
        print(f"writing random {shape} checkpoint ({params:,} params) to {path}", flush=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        init = RandomInit(gate_std=0.05, weight_std_by_prefix=INIT_STD_BY_PREFIX.get(shape, ()))
        write_random_checkpoint(tmp, config, seed=0, dtype="bfloat16", init=init, device=on)
        tmp.rename(path)  # atomic: a killed writer never leaves a half checkpoint behind
    return path


def random_prompts(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """`count` prompts of `length` token ids in [3, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def heldout_passages() -> list[str]:
    """The bundled model's validation documents (benchmarks/data/, never trained on)."""
    path = Path(__file__).resolve().parent / "data" / "heldout_passages.json"
    return json.loads(path.read_text())["passages"]


def decode_phase(records) -> tuple[int, float, int]:
    """(tokens, seconds, steps) of the step-log records without prefill work; a step lasts its
    device_s (CUDA) or from the previous applied step's done_s to its own; the first record (no
    predecessor) is skipped. The host clock charges a step with the submission of the step
    after it (e.g. a long eager prefill), so it understates decode throughput next to prefill."""
    tokens, seconds, steps = 0, 0.0, 0
    for before, record in zip(records, records[1:], strict=False):
        if record.prefill_tokens == 0:
            tokens += record.generated
            device_s = getattr(record, "device_s", None)
            seconds += device_s if device_s is not None else record.done_s - before.done_s
            steps += 1
    return tokens, seconds, steps
