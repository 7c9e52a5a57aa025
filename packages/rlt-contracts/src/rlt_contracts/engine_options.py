"""The engine's options as one tree of structs, each owned by the part that reads it
(`EngineOptions`: model, scheduler, runner with its speculation, pd; docs/architecture.md,
"Configuration"). Every option is a field declared once with its help (`rlt_contracts.options`),
from which the flat keywords of `LLM(...)`, the flags and docs/configuration.md's tables come;
each struct validates itself when it is built (ConfigurationError naming the option)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rlt_contracts.errors import ConfigurationError
from rlt_contracts.kv import KVLayoutSpec, parse_kv_layout
from rlt_contracts.options import Option, check_option_values
from rlt_contracts.pd import PDRole
from rlt_contracts.scheduler_config import SchedulerConfig

DEVICE_TYPES = ("auto", "cpu", "cuda")


def kv_layout_name(text: str) -> str:
    """A KV layout's canonical spelling ("ring:08" -> "ring:8"), by the one parser of layouts
    (`parse_kv_layout`: ValueError naming the accepted forms)."""
    return parse_kv_layout(text).value


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """model (docs/configuration.md, Model and device; docs/models.md)"""

    model: Annotated[
        str | Path | None,
        Option(
            "checkpoint directory, or a Hugging Face model id org/name, found in the Hugging "
            "Face cache or downloaded into it (default: the bundled model)"
        ),
    ] = None
    revision: Annotated[
        str | None,
        Option("with a Hugging Face model id: the branch, tag or commit to load (default: main)"),
    ] = None
    download_dir: Annotated[
        str | Path | None,
        Option(
            "with a Hugging Face model id: the Hugging Face cache it is found or downloaded in "
            "(default: huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else "
            "~/.cache/huggingface/hub)"
        ),
    ] = None
    tokenizer: Annotated[
        str | Path | None,
        Option(
            "directory of the tokenizer to use instead of the checkpoint's, or a Hugging Face "
            "model id (its main, in --download-dir's cache) (vLLM's; default: the checkpoint's "
            "own)"
        ),
    ] = None
    hf_overrides: Annotated[
        dict[str, Any] | None,
        Option(
            "JSON object of config.json keys applied before the model loads, e.g. "
            "'{\"num_loops\": 1}' (vLLM's --hf-overrides; default: none, config.json as it is)"
        ),
    ] = None
    max_model_loops: Annotated[
        int | None,
        Option(
            "the most loops a request may ask (max_loops); KV is sized for it (default: twice "
            "the checkpoint's count for a family with elastic depth, the checkpoint's count "
            "otherwise; requests that omit max_loops run the checkpoint's count or --max-loops)",
            positive=True,
        ),
    ] = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Option("weights' and activations' dtype (auto: the checkpoint's torch_dtype)"),
    ] = "auto"
    quantization: Annotated[
        Literal["fp8"] | None,
        Option(
            "fp8: the stack's projections in float8_e4m3fn with per-channel scales "
            "(default: none, the weights in --dtype)"
        ),
    ] = None
    quantize_lm_head: Annotated[bool, Option("with fp8, the LM head in fp8 too")] = False
    max_model_len: Annotated[
        int | None,
        Option(
            "context length in tokens (default: the model's max_position_embeddings)",
            positive=True,
        ),
    ] = None

    def __post_init__(self) -> None:
        check_option_values(self)
        if self.quantize_lm_head and self.quantization is None:
            raise ConfigurationError(
                ("quantize_lm_head", "quantization"), "quantize_lm_head needs quantization='fp8'"
            )
        if self.revision is not None and (
            self.model is None or not isinstance(self.revision, str) or not self.revision
        ):
            raise ConfigurationError(
                ("revision", "model"),
                f"a revision (a non-empty branch, tag or commit) picks a snapshot of a Hugging "
                f"Face model id; got revision {self.revision!r} for model {self.model!r}",
            )
        overrides = self.hf_overrides
        if overrides is not None and not (
            isinstance(overrides, dict) and all(isinstance(k, str) for k in overrides)
        ):
            raise ConfigurationError(
                "hf_overrides", f"must be a JSON object of config.json keys, got {overrides!r}"
            )


class SpeculationConfig(msgspec.Struct, frozen=True, kw_only=True):
    """self-speculative decoding (docs/configuration.md)"""

    num_tokens: Annotated[
        int,
        Option(
            "K > 0: draft K tokens per round with the first loops and verify them in one "
            "pass, losslessly (default: 0, off)",
            name="num_speculative_tokens",
        ),
    ] = 0
    draft_loops: Annotated[
        int,
        Option(
            "loops of the shared stack that draft (1 .. depth - 1)",
            name="speculative_draft_loops",
            positive=True,
        ),
    ] = 2
    disable_batch_size: Annotated[
        int | None,
        Option(
            "decode without speculation while more requests than this decode ('none': never pause)",
            name="speculative_disable_batch_size",
            positive=True,
        ),
    ] = 16

    def __post_init__(self) -> None:
        check_option_values(self)
        tokens = self.num_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigurationError(
                "num_speculative_tokens", f"must be a non-negative integer, got {tokens!r}"
            )


class RunnerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """device, KV storage and execution"""

    device: Annotated[str, Option("auto (CUDA when there is a GPU), cpu, cuda or cuda:N")] = "auto"
    kv_layout: Annotated[
        str,
        Option(
            "last_exited: a KV plane per loop depth; shared: one plane (1/depth the memory); "
            "ring:K: K planes, loop i at plane (i - 1) mod K (approximate below the loop cap)",
            metavar="{last_exited,shared,ring:K}",
            parse=kv_layout_name,
        ),
    ] = "last_exited"
    kv_cache_dtype: Annotated[
        Literal["auto", "fp8"],
        Option(
            "fp8: KV cache in float8_e4m3fn with per-layer scales (about 2x the tokens); "
            "auto: the model's dtype"
        ),
    ] = "auto"
    block_size: Annotated[int, Option("token positions per KV block", positive=True)] = 16
    num_kv_blocks: Annotated[
        int | None,
        Option(
            "KV pool size in blocks (default: sized from free memory on CUDA; on the CPU "
            "enough for --max-num-seqs full-length requests, at most --cpu-kv-cache-bytes)",
            positive=True,
        ),
    ] = None
    cpu_kv_cache_bytes: Annotated[
        int,
        Option(
            "on the CPU, the most bytes of a KV pool sized without --num-kv-blocks", positive=True
        ),
    ] = 2 << 30
    gpu_memory_utilization: Annotated[
        float,
        Option("share of the GPU's memory this engine may use (weights, activations, KV)"),
    ] = 0.9
    attention_backend: Annotated[
        str, Option("auto (chosen for the device and dtype), torch, triton or flash_attn")
    ] = "auto"
    cuda_graphs: Annotated[
        bool, Option("capture the decode tick as CUDA graphs on CUDA (default: on)")
    ] = True
    prefill_cuda_graphs: Annotated[
        bool, Option("with --cuda-graphs, run prompt chunks as CUDA graphs too (default: on)")
    ] = True
    fused_kernels: Annotated[
        bool, Option("fused Triton kernels in the recurrent step on CUDA (default: on)")
    ] = True
    batch_invariant: Annotated[
        bool,
        Option(
            "a request's output never depends on what else runs (default: off; it costs "
            "throughput; docs/serving.md, Reproducibility)",
            negatable=True,
        ),
    ] = False
    initial_state: Annotated[
        Literal["random", "zero"],
        Option(
            "how a family whose loop state starts from a random draw starts it: drawn per "
            "token from the request's seed and position, or zero (default: %(default)s)"
        ),
    ] = "random"
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        check_option_values(self)
        if not (self.device in DEVICE_TYPES or str(self.device).startswith("cuda:")):
            raise ConfigurationError(
                "device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        try:
            msgspec.structs.force_setattr(self, "kv_layout", kv_layout_name(self.kv_layout))
        except ValueError as exc:
            raise ConfigurationError("kv_layout", str(exc)) from None
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigurationError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def layout(self) -> KVLayoutSpec:
        return parse_kv_layout(self.kv_layout)

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda" for a given device; "auto" stays "auto" (the engine resolves it)."""
        if self.device == "auto":
            return "auto"
        return "cuda" if str(self.device).startswith("cuda") else "cpu"


class PDConfig(msgspec.Struct, frozen=True, kw_only=True):
    """prefill/decode disaggregation (docs/pd.md)"""

    role: Annotated[
        PDRole,
        Option(
            "this instance's role behind `rlt pd serve` (default: none, a whole engine)",
            name="pd_role",
            flags=("--pd-role", "--role"),
        ),
    ] = PDRole.NONE
    kv_timeout_s: Annotated[
        float,
        Option(
            "decode: seconds a request may wait for its KV before it fails", name="pd_kv_timeout_s"
        ),
    ] = 600.0
    kv_lease_s: Annotated[
        float,
        Option(
            "decode: seconds a cancelled transfer's blocks stay held without the prefill "
            "side's confirmation (must exceed --pd-write-timeout-s)",
            name="pd_kv_lease_s",
        ),
    ] = 480.0
    write_timeout_s: Annotated[
        float,
        Option(
            "prefill: seconds one posted KV write may take before the transfer fails",
            name="pd_write_timeout_s",
        ),
    ] = 300.0
    max_inflight_bytes: Annotated[
        int | None,
        Option(
            "prefill: bytes of posted, unfinished KV writes (default: twice the KV of one "
            "step's prompt tokens, at least 256 MiB)",
            name="pd_max_inflight_bytes",
        ),
    ] = None

    def __post_init__(self) -> None:
        check_option_values(self)
        for name in ("kv_timeout_s", "kv_lease_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"pd_{name}", f"must be > 0, got {getattr(self, name)!r}")
        if self.kv_lease_s <= self.write_timeout_s:
            raise ConfigurationError(
                ("pd_kv_lease_s", "pd_write_timeout_s"),
                f"the lease ({self.kv_lease_s:g} s) must exceed the write timeout "
                f"({self.write_timeout_s:g} s), or a late write could land in a reused block",
            )
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < 1 << 20:
            raise ConfigurationError(
                "pd_max_inflight_bytes", f"must be >= 1 MiB, got {self.max_inflight_bytes}"
            )


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """engine"""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    runner: RunnerConfig = msgspec.field(default_factory=RunnerConfig)
    pd: PDConfig = msgspec.field(default_factory=PDConfig)
    async_scheduling: Annotated[
        bool, Option("schedule the next step while the device runs the current one (default: on)")
    ] = True
    cache_dir: Annotated[
        str | Path | None,
        Option(
            "where start-up keeps the kernel choices it measured on CUDA for the next start "
            "(default: $RLT_CACHE_DIR, else $XDG_CACHE_HOME/rlt, else ~/.cache/rlt; off: none)"
        ),
    ] = None
    # the engine core's live statistics line (rlt.engine.stats_log): every server that runs an
    # engine (rlt serve, its PD instances, rlt ray), not LLM
    log_stats: Annotated[
        bool,
        Option(
            "no live statistics lines (default: they are on)",
            flags=("--disable-log-stats",),
            negatable=False,
        ),
    ] = True
    stats_interval_s: Annotated[
        float,
        Option(
            "while the engine has work, one INFO line of prompt and generation throughput, "
            "running and waiting requests, KV use, prefix hits and loop mix every SECONDS, "
            "whatever --log-level says (default: %(default)g, as vLLM)",
            flags=("--stats-interval",),
            metavar="SECONDS",
        ),
    ] = 10.0

    def __post_init__(self) -> None:
        check_option_values(self)
        interval = self.stats_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval < float("inf")  # also refuses NaN
        ):
            raise ConfigurationError(
                "stats_interval_s", f"must be a number of seconds > 0, got {interval!r}"
            )
