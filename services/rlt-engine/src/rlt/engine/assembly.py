"""Builds an engine's parts from `EngineConfig`: the only place concrete packages meet."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from msgspec.structs import replace
from rlt_attention import select_attention_backend
from rlt_contracts import (
    AttentionRequirements,
    ConfigurationError,
    KVLayout,
    ModelInfo,
    PDRole,
    PromptMask,
    RunnerConfig,
)
from rlt_kv import KVCacheManager
from rlt_models import LoopedModelBase, load_model, load_tokenizer
from rlt_models.kv_scales import MAX_CALIBRATION_TOKENS, calibrate_kv_scales
from rlt_models.model_dir import check_model_dir
from rlt_models.model_source import ModelSource, resolve_model_source, resolve_tokenizer_dir
from rlt_models.sample_text import SAMPLE_TEXT
from rlt_runner import (
    FP8,
    KVMemoryPlan,
    KVScales,
    KVStorage,
    ModelRunner,
    plan_kv_blocks,
    profile_activation_peak,
    profile_blocks,
)
from rlt_sampling import Sampler
from rlt_scheduler import (
    Scheduler,
    max_rounds_per_step,
)

from rlt.engine.config import EngineConfig
from rlt.engine.core import EngineCore
from rlt.engine.family_setup import family_setup
from rlt.engine.kv_capacity import KVPoolCapacity, kv_pool_capacity
from rlt.engine.pd_link import HandoffPortFactory
from rlt.engine.startup import StartupClock, keep_kernel_choices, restore_kernel_choices
from rlt.engine.structured_output import XGrammarCompiler

if TYPE_CHECKING:
    from rlt.engine.pd_assembly import PDParts

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"
# SHA-256 of the shipped weights (docs/embedded-model.md); tests check the file against it.
DEFAULT_MODEL_SHA256 = "10a62a2cba0bed7a599fac26c38fe48776c0895366032e2cb8ae77d1b5fa5216"


@dataclass(frozen=True)
class EngineParts:
    core: EngineCore
    model: LoopedModelBase
    model_dir: Path
    device: torch.device
    attention_backend: str
    attention_reason: str
    memory_plan: KVMemoryPlan
    max_model_len: int
    weight_dtype: str = ""  # the stack's projections (ModelInfo)
    kv_cache_dtype: str = ""
    kv_capacity: KVPoolCapacity | None = None  # what the pool holds (layout, cap)
    pd: PDParts | None = None  # a prefill or decode instance's NIXL transport and port
    model_name: str = ""  # what front ends call the model by default (ModelSource.name)
    attention_warning: str | None = None  # CUDA graphs requested, backend cannot be captured
    constraint_compiler: XGrammarCompiler | None = None  # structured output's grammars
    tokenizer_dir: Path | None = None  # --tokenizer's directory (None: model_dir's tokenizer)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the pool holds at full depth (0 when unknown)."""
        return self.kv_capacity.tokens if self.kv_capacity is not None else 0

    @property
    def tokenizer_source(self) -> Path:
        """Where the engine's tokenizer loads from."""
        return self.tokenizer_dir or self.model_dir


def resolve_model(
    model: str | Path | None,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    tokenizer: bool = False,
) -> ModelSource:
    """Where the model's files are: None: the bundled model; else a checkpoint directory or a
    Hugging Face model id found in (or downloaded into) the Hugging Face cache at `revision`
    (`rlt_models.model_source`). The directory is checked for config.json and the weights,
    and with `tokenizer` for a tokenizer's files (`rlt_models.model_dir`): token ids need
    none, the servers and `rlt generate` do."""
    if model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").exists():
            raise ConfigurationError(
                "model", "no model directory given and the bundled default model is missing"
            )
        return ModelSource(given=str(DEFAULT_MODEL_DIR), local_dir=DEFAULT_MODEL_DIR)
    source = resolve_model_source(model, revision=revision, download_dir=download_dir)
    check_model_dir(source.local_dir, tokenizer=tokenizer)
    return source


def resolve_model_dir(
    model: str | Path | None,
    *,
    tokenizer: bool = False,
    revision: str | None = None,
    download_dir: str | Path | None = None,
) -> Path:
    """`resolve_model`'s checkpoint directory."""
    return resolve_model(
        model, revision=revision, download_dir=download_dir, tokenizer=tokenizer
    ).local_dir


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError("device", "CUDA was requested but no CUDA device is available")
    return device


def build_engine(
    config: EngineConfig,
    *,
    model: LoopedModelBase | None = None,
    handoff_port: HandoffPortFactory | None = None,
) -> EngineParts:
    """The engine's parts. `model`: already loaded from `config.model` with its dtype on its
    device (benchmarks share one between engines); None loads it. `handoff_port`: a PD
    instance's KV handoff port instead of NIXL's (tests join two engines in one process)."""
    clock = StartupClock()
    wanted = config.model
    source = resolve_model(wanted.model, revision=wanted.revision, download_dir=wanted.download_dir)
    model_dir = source.local_dir
    tokenizer_dir = resolve_tokenizer_dir(wanted.tokenizer, download_dir=wanted.download_dir)
    tokenizer_source = tokenizer_dir or model_dir
    device = resolve_device(config.runner.device)
    if model is None:
        with clock.phase("weights", lambda: _weights_line(model, device)):
            model = load_model(
                model_dir,
                dtype=None if wanted.dtype == "auto" else wanted.dtype,
                device=device,
                quantization=wanted.quantization,
                quantize_lm_head=wanted.quantize_lm_head,
                hf_overrides=wanted.hf_overrides,
                max_model_loops=wanted.max_model_loops,
            )
    elif wanted.max_model_loops not in (None, model.shape.num_loops):
        raise ConfigurationError(
            "max_model_loops",
            f"the given model is sized for {model.shape.num_loops} loops, not "
            f"{wanted.max_model_loops}: load it with max_model_loops={wanted.max_model_loops}",
        )
    cache_dir = config.resolved_cache_dir()
    restored_choices = restore_kernel_choices(cache_dir, device)
    model.fused_path = "auto" if config.runner.fused_kernels else "off"
    model.batch_invariant = config.runner.batch_invariant
    shape = model.shape
    max_model_len = wanted.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ConfigurationError(
            "max_model_len",
            f"{max_model_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}",
        )
    setup = family_setup(
        config, model.family, model_depth=shape.num_loops, max_model_len=max_model_len
    )
    config, exit_policy = setup.config, setup.exit_policy
    runner_config, batch = config.runner, config.scheduler
    layout = runner_config.layout
    requirements = AttentionRequirements(
        device_type=device.type,
        dtype=str(model.dtype).removeprefix("torch."),
        head_dim=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=runner_config.block_size,
        kv_layout=layout.kind,
        cuda_graphs=runner_config.cuda_graphs and device.type == "cuda",
        batch_invariant=model.batch_invariant,
        kv_cache_dtype=runner_config.kv_cache_dtype,
        bidirectional_prompt=model.family.prompt_mask is PromptMask.PREFIX_LM,
        sliding_window=model.family.kv.sliding_window,
    )
    selection = select_attention_backend(requirements, runner_config.attention_backend)
    logger.info("attention backend %s: %s", selection.name, selection.reason)
    if selection.warning:
        logger.warning("attention backend %s: %s", selection.name, selection.warning)
    loop_planes = layout.storage_planes(shape.num_loops)
    num_planes = loop_planes + model.family.kv.stage_planes
    block_size = runner_config.block_size
    pages_per_request = -(-max_model_len // block_size)
    kv_scales = None
    if runner_config.kv_cache_dtype == "fp8":
        with clock.phase("fp8 KV scales"):
            kv_scales = fp8_kv_scales(model, tokenizer_source)
    kv_dtype = model.dtype if kv_scales is None else FP8
    bytes_per_block = KVStorage.bytes_per_block(
        shape.num_layers, block_size, shape.num_kv_heads, shape.head_dim, kv_dtype
    )

    def make_runner(num_kv_blocks: int, options: RunnerConfig) -> ModelRunner:
        return ModelRunner(
            model,
            selection.backend,
            Sampler(),
            options,
            batch,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            device=device,
            dtype=model.dtype,
            kv_scales=kv_scales,
            trace_capacity=max_model_len if exit_policy.name == "trace" else 1,
            distribution_exits=exit_policy.reads_distribution,
            max_speculative_rounds=max_rounds_per_step(batch, shape.num_loops),
        )

    activation = None
    if device.type == "cuda" and runner_config.num_kv_blocks is None:
        with clock.phase("memory profiling", lambda: str(activation)):
            activation = _profile_activations(config, model, make_runner, max_model_len, num_planes)
    memory_plan = plan_kv_blocks(
        device=device,
        bytes_per_block=bytes_per_block,
        useful_blocks=batch.max_num_seqs * pages_per_request * num_planes,
        explicit_blocks=runner_config.num_kv_blocks,
        gpu_memory_utilization=runner_config.gpu_memory_utilization,
        activation=activation,
        cpu_budget_bytes=runner_config.cpu_kv_cache_bytes,
    )
    kv = KVCacheManager(
        num_blocks=memory_plan.num_blocks,
        block_size=block_size,
        num_planes=num_planes,
        enable_prefix_caching=batch.enable_prefix_caching,
    )
    # Structured output: grammars over the checkpoint's tokenizer (loaded on first use).
    constraint_compiler = XGrammarCompiler(
        lambda: load_tokenizer(tokenizer_source),
        vocab_size=shape.vocab_size,
        stop_token_ids=shape.eos_token_ids,
    )
    scheduler = Scheduler(
        batch,
        kv,
        model_depth=shape.num_loops,
        vocab_size=shape.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=shape.eos_token_ids,
        exit_policy=exit_policy,
        prefix_caching=kv.prefix_caching,
        constraint_compiler=constraint_compiler,
        default_min_loops=setup.default_min_loops,
        default_loops=model.family.default_loops,
        speculation=runner_config.speculation,
    )
    graphs = runner_config.cuda_graphs and device.type == "cuda"
    with clock.phase(
        "CUDA graphs and kernel selection" if graphs else "runner",
        lambda: _graphs_line(runner) if graphs else "",
    ):
        runner = make_runner(memory_plan.num_blocks, runner_config)
    keep_kernel_choices(cache_dir, device, restored_choices)
    if runner.graphs is None and device.type == "cuda":
        log = logger.warning if runner_config.cuda_graphs else logger.info
        log("decode runs eagerly: %s", runner.graphs_disabled_reason)
    pd_link = pd = None
    if config.pd.role is not PDRole.NONE:
        from rlt.engine.pd_assembly import build_pd  # imports NIXL: only PD instances need it

        try:
            pd_link, pd = build_pd(
                config, model_dir, scheduler, kv, runner.pd_regions, handoff_port=handoff_port
            )
        except BaseException:
            runner.close()
            raise
        logger.info("PD %s instance, transport agent %s", config.pd.role, pd_link.agent_name)
    core = EngineCore(scheduler, runner, kv, pd=pd_link, async_scheduling=config.async_scheduling)
    weight_dtype = weight_dtype_name(model)
    model_dtype = str(model.dtype).removeprefix("torch.")
    kv_dtype_name = str(kv_dtype).removeprefix("torch.")
    capacity = kv_pool_capacity(
        layout=layout.value,
        loop_planes=loop_planes,
        stage_planes=model.family.kv.stage_planes,
        num_blocks=memory_plan.num_blocks,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        max_model_len=max_model_len,
    )
    logger.info(
        "start-up: KV pool: %s %d blocks of %d positions x %d plane(s) = %d tokens "
        "(%.2f GiB, %s bytes per token); %d requests of max_model_len %d fit at once "
        "(max_num_seqs %d; kv_layout %s, %d loop plane(s) at a cap of %d loops); "
        "weights: projections %s, LM head %s",
        kv_dtype_name,
        memory_plan.num_blocks,
        block_size,
        num_planes,
        capacity.tokens,
        memory_plan.num_blocks * bytes_per_block / 2**30,
        f"{capacity.bytes_per_token:,}",
        capacity.full_length_requests,
        max_model_len,
        batch.max_num_seqs,
        capacity.layout,
        capacity.loop_planes,
        shape.num_loops,
        weight_dtype,
        "float8_e4m3fn" if model.quantized_lm_head else model_dtype,
    )
    clock.ready()
    return EngineParts(
        core=core,
        model=model,
        model_dir=model_dir,
        device=device,
        attention_backend=selection.name,
        attention_reason=selection.reason,
        memory_plan=memory_plan,
        max_model_len=max_model_len,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_dtype_name,
        kv_capacity=capacity,
        pd=pd,
        model_name=source.name,
        attention_warning=selection.warning,
        constraint_compiler=constraint_compiler,
        tokenizer_dir=tokenizer_dir,
    )


def _weights_line(model: LoopedModelBase | None, device: torch.device) -> str:
    if model is None:  # the load failed: its exception is on its way
        return ""
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return f"{size / 1e9:.2f} GB on {device} (projections {weight_dtype_name(model)})"


def _graphs_line(runner: ModelRunner) -> str:
    if runner.graphs is None:
        return f"none ({runner.graphs_disabled_reason})"
    parts = [f"{runner.graphs.captured} decode ticks"]
    if runner.prefill_graphs is not None:
        parts.append(f"{runner.prefill_graphs.captured} prefill steps")
    if runner.shared_waves is not None:
        parts.append("SHARED prefill waves")
    if runner.speculative_graphs is not None:
        parts.append("speculative rounds")
    return ", ".join(parts)


def fp8_kv_scales(model: LoopedModelBase, tokenizer_dir: Path) -> KVScales:
    """The fp8 KV cache's per-layer scales: the checkpoint's, else calibrated on the sample
    text through the engine's tokenizer (`tokenizer_dir`; rlt_models.kv_scales)."""
    if model.checkpoint_kv_scales is not None:
        keys, values = model.checkpoint_kv_scales
        source = "checkpoint"
    else:
        tokenizer = load_tokenizer(tokenizer_dir)
        token_ids = tokenizer.encode(
            SAMPLE_TEXT, truncation=True, max_length=MAX_CALIBRATION_TOKENS
        )
        keys, values = calibrate_kv_scales(model, token_ids)
        source = f"calibrated on {len(token_ids)} sample tokens"
    bounds = f"keys {min(keys)}..{max(keys)}, values {min(values)}..{max(values)}"
    logger.info("fp8 KV scales (%s): %s", source, bounds)
    return KVScales(keys, values)


def weight_dtype_name(model: LoopedModelBase) -> str:
    """The dtype of the stack's projections: float8_e4m3fn when quantized, else the model's."""
    if model.quantization == "fp8":
        return "float8_e4m3fn"
    return str(model.dtype).removeprefix("torch.")


SHARED_PROFILE_POSITIONS = 8


def _profile_activations(config, model, make_runner, max_model_len: int, num_planes: int):
    """Peak activations of the heaviest prefill chunk and decode tick, measured by running
    them on a throw-away runner with a tiny pool (see rlt_runner.memory)."""
    shape, batch, options = model.shape, config.scheduler, config.runner
    prefill_tokens = min(batch.max_num_batched_tokens, max_model_len - 1)
    if options.layout.kind is KVLayout.SHARED:
        # SHARED prefill runs one position per wave: its peak is a wave's, whatever the chunk
        # length, and profiling a full chunk eagerly position by position took ~50 s on an
        # H200 (1,100 positions of Ouro-1.4B) for nothing.
        prefill_tokens = min(prefill_tokens, SHARED_PROFILE_POSITIONS)
    blocks = profile_blocks(
        prefill_tokens,
        batch.max_num_seqs,
        options.block_size,
        num_planes,
        lookahead=options.speculation.num_tokens,
    )
    runner = make_runner(blocks, replace(options, cuda_graphs=False))
    try:
        with torch.inference_mode():
            profile = profile_activation_peak(
                runner,
                prefill_tokens=prefill_tokens,
                rows=batch.max_num_seqs,
                vocab_size=shape.vocab_size,
                model_depth=shape.num_loops,
            )
    finally:
        runner.close()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    logger.info("profiled activations: %s", profile)
    return profile


def model_info(parts: EngineParts) -> ModelInfo:
    """What front ends show about the model an engine serves."""
    shape = parts.model.shape
    return ModelInfo(
        name=parts.model_name or parts.model_dir.name,
        path=str(parts.model_dir),
        max_model_len=parts.max_model_len,
        vocab_size=shape.vocab_size,
        num_loops=shape.num_loops,
        eos_token_ids=shape.eos_token_ids,
        weight_dtype=parts.weight_dtype,
        kv_cache_dtype=parts.kv_cache_dtype,
        kv_capacity_tokens=parts.kv_capacity_tokens,
        family=parts.model.family.name,
        exit_signal=parts.model.family.exit_signal.value,
        default_loops=parts.model.family.default_loops,
    )
