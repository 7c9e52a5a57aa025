"""`EngineConfig`: every engine option, validated once at construction (ConfigurationError)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlt_contracts import ConfigurationError, KVLayoutSpec, PDRole, parse_kv_layout
from rlt_scheduler import SchedulerConfig, SchedulingMode

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_TYPES = ("auto", "cpu", "cuda")
# Batch sizing when not given, per device type: (max_num_seqs, max_num_batched_tokens,
# prefill_chunk_size). CUDA's is the configuration measured on an H200 (docs/results.md).
BATCH_DEFAULTS = {"cpu": (8, 128, 128), "cuda": (128, 4096, 1024)}


def _device_type(device: str) -> str:
    if device == "auto":
        import torch  # only to see whether "auto" means CUDA

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if str(device).startswith("cuda") else "cpu"


INITIAL_STATES = ("random", "zero")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (Python keywords; the CLI spells them --kebab-case).

    model: checkpoint directory, or a Hugging Face model id (`org/name`) found in the
      Hugging Face cache or downloaded into it (rlt_models.model_source; a path that exists is
      a directory); None = the bundled default model.
    revision: with a model id, the branch, tag or commit to load (None: main).
    download_dir: with a model id, the Hugging Face cache directory it is found or downloaded
      in (None: huggingface_hub's, from $HF_HUB_CACHE / $HF_HOME).
    tokenizer: directory of the tokenizer to use instead of the checkpoint's (vLLM's
      --tokenizer; None: the checkpoint's own).
    dtype: "auto" (the checkpoint's torch_dtype), "float32", "bfloat16" or "float16".
    quantization: None, or "fp8": the stack's projections as float8_e4m3fn with per-channel
      scales, quantized at load (a compressed-tensors fp8 checkpoint loads as fp8 anyway).
    quantize_lm_head: with fp8, the LM head too (else it stays in `dtype`).
    kv_cache_dtype: "auto" (the model dtype) or "fp8": the KV cache as float8_e4m3fn with one
      key and one value scale per layer (the checkpoint's k_scale/v_scale, else calibrated at
      load: rlt_models.kv_scales), about twice the tokens in the same memory.
    device: "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N".
    kv_layout: "last_exited" (per-depth planes), "shared" (one overwritten plane) or "ring:K"
      (K step planes, loop i at plane (i - 1) mod K; approximate below the loop cap), parsed
      by `rlt_contracts.parse_kv_layout` (`layout` is the parsed `KVLayoutSpec`).
    scheduling_mode: "refill" or "no_refill".
    num_kv_blocks: KV pool size in blocks (None = sized from free memory on CUDA, or enough
      for max_num_seqs full-length requests, capped at cpu_kv_cache_bytes, on the CPU).
    block_size: token positions per KV block.
    max_model_len: context length in tokens (None = the model's max_position_embeddings).
    attention_backend: "auto" or a backend name ("torch", "triton", "flash_attn").
    gpu_memory_utilization: this engine's share of the GPU memory, per instance as in vLLM.
    cuda_graphs: capture the decode tick as CUDA graphs (one per padded batch size and sampling
      mode) when on CUDA with a graph-capable attention backend; otherwise, or if capture fails,
      run it eagerly.
    prefill_cuda_graphs: with cuda_graphs, also run prompt chunks as CUDA graphs: a
      LAST_EXITED prefill step per (token bucket, chunk-count bucket; one chunk's graphs are
      captured at start for every token bucket, the rest on first use), and the SHARED
      layout's position waves (captured at start); False runs them eagerly.
      Batch-invariant engines always prefill eagerly.
    cache_dir: where start-up keeps what it measured for the next start (the projections'
      kernel choices on CUDA, `rlt_models.kernel_choice_cache`); None: $RLT_CACHE_DIR, else
      $XDG_CACHE_HOME/rlt, else ~/.cache/rlt; "off" (here or in $RLT_CACHE_DIR): nothing is
      read or written.
    fused_kernels: run the recurrent step's elementwise work as fused Triton kernels (norm +
      residual, RoPE, SwiGLU) when on CUDA; False keeps the eager torch ops. (Attention is the
      selected backend's either way.)
    max_num_seqs / max_num_batched_tokens / prefill_chunk_size: running requests, token rows
      per step, prompt tokens of one request per step; None: 8 / 128 / 128 on the CPU and
      128 / 4,096 / 1,024 on CUDA (the chunk never above a given token budget).
    async_scheduling: schedule and submit the next step while the device runs the current one
      (results are identical to the synchronous loop; False collects every step at once).
    decode_ticks_per_step: most decode loop ticks per step without a host round trip (the
      device applies exits, sampling and stop rules itself); steps with prompt work run
      prefill_step_decode_ticks.
    prefill_step_decode_ticks: decode ticks of a step that can compute prompts: 1 (default:
      the lowest time to first token) or "auto" (the model depth: each decoding request makes
      about one token per prompt step) or N; never above decode_ticks_per_step.
    scheduler_delay_factor: F > 0: while requests run, a new prompt waits until F x the
      latest prompt step's duration passed since the oldest waiting request arrived, so
      prompts arriving close together start in one step (vLLM's option); 0 (default): at once.
    batch_invariant: every request's logits, exit decisions and samples depend only on its own
      tokens, never on what else runs (docs/serving.md, "Reproducibility"): batch-invariant
      GEMMs, elementwise ops and attention. Off by default: it costs 24-53% of end-to-end output
      throughput on the CPU and 38-91% on an H200 (docs/results.md).

    Memory and scheduling features (see docs/configuration.md):
    enable_prefix_caching: share full prompt pages across requests (all depths).
    incremental_kv: claim KV pages as requests grow instead of a lifetime reservation.
    kv_watermark: fraction of the pool kept free at admission while other requests run.
    scheduling_policy: "fcfs" or "priority" (SamplingParams.priority, lower first).
    enable_preemption: lossless CPU-snapshot preemption under memory pressure / for priority.
    exit_policy: None (default: the family's own signal: "hazard" for a gated family such as
      Ouro, "fixed" for one without an exit signal), "hazard", "hazard_delayed", "fixed" or
      "trace" ("ouro" and "ouro_delayed" are accepted for the hazard rules); exit_trace: JSON
      file of {request_id: [depth per output token]} read by the "trace" policy.
    hf_overrides: config.json keys applied before the model's family reads it (vLLM's
      `hf_overrides`), e.g. {"num_loops": 1}.
    max_model_loops: the engine's loop cap, the most loops a request may ask (`max_loops`);
      the model depth the KV planes, runner and scheduler are sized for. None: the family's
      default (twice the checkpoint's count for a family with elastic depth, the checkpoint's
      count otherwise). Requests that omit `max_loops` still run the checkpoint's count. At
      least that count; at most the family's loop limit (Ouro: its checkpoint's depth).
    initial_state: "random" (default) or "zero": how a family whose loop state starts from a
      random draw (Huginn-0125's like-init) starts it: drawn per token from its request's seed
      and position, or zero. Other families have no initial-state choice and ignore it.
    max_num_batched_token_loops: cap on token x loop passes per step (None: no cap).
    admission_scan_limit / max_admission_bypasses: bounded-bypass admission.

    Self-speculative decoding (docs/configuration.md, "Speculative decoding"):
    num_speculative_tokens: K > 0 drafts K tokens per round with the model's first loops and
      verifies them at every position's own exit depth in one pass (lossless: greedy output
      and exit depths are those of plain decoding; sampled output has the same distribution);
      0 (default) decodes without speculation.
    speculative_draft_loops: D, the loops of the shared stack that draft (1 <= D < depth).
    speculative_disable_batch_size: steps in which more requests than this decode run without
      speculation (vLLM's disable_by_batch_size); None: never pause.

    Prefill/decode disaggregation (docs/pd.md):
    pd_role: "none" (a whole engine), "prefill" or "decode" (KV moves over NIXL).
    pd_kv_timeout_s: decode: longest wait from admission until a request's KV has landed
      (the prefill instance's queueing and prefill included); then the request fails.
    pd_kv_lease_s: decode: after a cancelled or failed transfer, how long its blocks stay held
      without the prefill instance's "drained" (it may be dead); must exceed the prefill
      instances' pd_write_timeout_s so that no late write lands in a reused block.
    pd_write_timeout_s: prefill: lease of one posted write; past it the transfer fails.
    pd_max_inflight_bytes: prefill: bytes of posted, unfinished KV writes (later chunks wait);
      None: twice the KV of one step's prompt tokens (max_num_batched_tokens at every plane),
      at least 256 MiB (`pd_assembly.default_max_inflight_bytes`).

    Live statistics (docs/serving.md, "Live engine statistics"; read by the engine core's loop,
    `rlt.engine.stats_log`, so by `rlt serve`, PD instances and Ray replicas, not by `LLM`):
    log_stats: one INFO line of throughput, queue, KV and loop mix every stats_interval_s
      seconds while the engine has work (vLLM's default; False: vLLM's --disable-log-stats).
    stats_interval_s: seconds between those lines (default 10, as vLLM's).
    """

    model: str | Path | None = None
    revision: str | None = None
    download_dir: str | Path | None = None
    tokenizer: str | Path | None = None
    dtype: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    kv_layout: str = "last_exited"
    scheduling_mode: str = "refill"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    prefill_cuda_graphs: bool = True
    cache_dir: str | Path | None = None
    fused_kernels: bool = True
    async_scheduling: bool = True
    decode_ticks_per_step: int = 8
    prefill_step_decode_ticks: int | str = 1
    scheduler_delay_factor: float = 0.0
    batch_invariant: bool = False
    cpu_kv_cache_bytes: int = 2 << 30
    max_waiting_requests: int = 4096
    enable_prefix_caching: bool = False
    incremental_kv: bool = False
    kv_watermark: float = 0.0
    scheduling_policy: str = "fcfs"
    enable_preemption: bool = False
    exit_policy: str | None = None
    exit_trace: str | Path | None = None
    hf_overrides: dict[str, Any] | None = None
    max_model_loops: int | None = None
    initial_state: str = "random"
    max_num_batched_token_loops: int | None = None
    admission_scan_limit: int = 64
    max_admission_bypasses: int = 8
    num_speculative_tokens: int = 0
    speculative_draft_loops: int = 2
    speculative_disable_batch_size: int | None = 16
    pd_role: str = "none"
    pd_kv_timeout_s: float = 600.0
    pd_kv_lease_s: float = 480.0
    pd_write_timeout_s: float = 300.0
    pd_max_inflight_bytes: int | None = None
    log_stats: bool = True
    stats_interval_s: float = 10.0

    def resolved_cache_dir(self) -> Path | None:
        """The cache directory start-up uses (cache_dir above); None when "off"."""
        given = self.cache_dir if self.cache_dir is not None else os.environ.get("RLT_CACHE_DIR")
        if given == "off":
            return None
        if given:
            return Path(given).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "rlt"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigurationError(
                "dtype", f"must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ConfigurationError(
                "quantization", f"must be None or 'fp8', got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigurationError(
                "kv_cache_dtype", f"must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}"
            )
        if self.quantize_lm_head not in (False, True):
            raise ConfigurationError(
                "quantize_lm_head", f"must be True or False, got {self.quantize_lm_head!r}"
            )
        if self.quantize_lm_head and self.quantization is None:
            raise ConfigurationError(
                ("quantize_lm_head", "quantization"), "quantize_lm_head needs quantization='fp8'"
            )
        if not (self.device in DEVICE_TYPES or str(self.device).startswith("cuda:")):
            raise ConfigurationError(
                "device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        self._fill_batch_defaults()
        try:
            parse_kv_layout(self.kv_layout)
        except ValueError as exc:
            raise ConfigurationError("kv_layout", str(exc)) from None
        if self.initial_state not in INITIAL_STATES:
            raise ConfigurationError(
                "initial_state", f"must be one of {INITIAL_STATES}, got {self.initial_state!r}"
            )
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_model_len",
            "cpu_kv_cache_bytes",
            "max_model_loops",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigurationError(name, f"must be a positive integer, got {value!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigurationError(
                "batch_invariant", f"must be True or False, got {self.batch_invariant!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigurationError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self.scheduler_config()  # validates the batching and memory options
        draft_loops = self.speculative_draft_loops
        if isinstance(draft_loops, bool) or not isinstance(draft_loops, int) or draft_loops < 1:
            raise ConfigurationError(
                "speculative_draft_loops", f"must be a positive integer, got {draft_loops!r}"
            )
        if self.revision is not None and (
            self.model is None or not isinstance(self.revision, str) or not self.revision
        ):
            raise ConfigurationError(
                ("revision", "model"),
                f"a revision (a non-empty branch, tag or commit) picks a snapshot of a Hugging "
                f"Face model id; got revision {self.revision!r} for model {self.model!r}",
            )
        self._check_pd()
        if not isinstance(self.log_stats, bool):
            raise ConfigurationError("log_stats", f"must be True or False, got {self.log_stats!r}")
        interval = self.stats_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not (
                0 < interval < float("inf")  # also refuses NaN
            )
        ):
            raise ConfigurationError(
                "stats_interval_s", f"must be a number of seconds > 0, got {interval!r}"
            )
        if self.exit_policy == "trace" and self.exit_trace is None:
            raise ConfigurationError(
                ("exit_policy", "exit_trace"), "exit_policy 'trace' needs an exit_trace file"
            )
        if self.exit_trace is not None and self.exit_policy != "trace":
            raise ConfigurationError(
                ("exit_trace", "exit_policy"),
                f"exit_trace is only read by exit_policy 'trace', not {self.exit_policy!r}",
            )
        overrides = self.hf_overrides
        if overrides is not None and not (
            isinstance(overrides, dict) and all(isinstance(k, str) for k in overrides)
        ):
            raise ConfigurationError(
                "hf_overrides", f"must be a JSON object of config.json keys, got {overrides!r}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from keyword options; unknown names raise ConfigurationError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigurationError(
                tuple(unknown), f"unknown engine option(s); known: {sorted(known)}"
            )
        return cls(**options)

    def _fill_batch_defaults(self) -> None:
        """None batch sizes take the device type's defaults (BATCH_DEFAULTS); a default chunk
        never exceeds a given token budget."""
        seqs, tokens, chunk = BATCH_DEFAULTS[_device_type(self.device)]
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", seqs)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", tokens)
        if self.prefill_chunk_size is None:
            budget = self.max_num_batched_tokens
            fitted = min(chunk, budget) if isinstance(budget, int) else chunk
            object.__setattr__(self, "prefill_chunk_size", fitted)

    def _check_pd(self) -> None:
        try:
            PDRole(self.pd_role)
        except ValueError:
            raise ConfigurationError(
                "pd_role", f"must be one of {[r.value for r in PDRole]}, got {self.pd_role!r}"
            ) from None
        for name in ("pd_kv_timeout_s", "pd_kv_lease_s", "pd_write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.pd_kv_lease_s <= self.pd_write_timeout_s:
            raise ConfigurationError(
                ("pd_kv_lease_s", "pd_write_timeout_s"),
                f"the lease ({self.pd_kv_lease_s:g} s) must exceed the write timeout "
                f"({self.pd_write_timeout_s:g} s), or a late write could land in a reused block",
            )
        if self.pd_max_inflight_bytes is not None and self.pd_max_inflight_bytes < 1 << 20:
            raise ConfigurationError(
                "pd_max_inflight_bytes", f"must be >= 1 MiB, got {self.pd_max_inflight_bytes}"
            )

    @property
    def role(self) -> PDRole:
        return PDRole(self.pd_role)

    @property
    def layout(self) -> KVLayoutSpec:
        return parse_kv_layout(self.kv_layout)

    def scheduler_config(self, *, whole_prompts: bool = False) -> SchedulerConfig:
        """`whole_prompts`: the model's prompts are computed in one step (prefix-LM families;
        the engine then gives it a token budget and chunk of the context length)."""
        try:
            mode = SchedulingMode(self.scheduling_mode)
        except ValueError:
            raise ConfigurationError(
                "scheduling_mode",
                f"must be one of {[m.value for m in SchedulingMode]}, got {self.scheduling_mode!r}",
            ) from None
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_batched_token_loops=self.max_num_batched_token_loops,
            prefill_chunk_size=self.prefill_chunk_size,
            mode=mode,
            policy=self.scheduling_policy,
            incremental_kv=self.incremental_kv,
            watermark_ratio=self.kv_watermark,
            enable_preemption=self.enable_preemption,
            admission_scan_limit=self.admission_scan_limit,
            max_admission_bypasses=self.max_admission_bypasses,
            max_waiting_requests=self.max_waiting_requests,
            decode_ticks_per_step=self.decode_ticks_per_step,
            prefill_step_decode_ticks=self.prefill_step_decode_ticks,
            scheduler_delay_factor=self.scheduler_delay_factor,
            num_speculative_tokens=self.num_speculative_tokens,
            speculative_disable_batch_size=self.speculative_disable_batch_size,
            whole_prompts=whole_prompts,
        )
