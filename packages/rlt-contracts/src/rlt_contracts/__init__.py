"""rlt-contracts: the typed contracts that cross rlt package boundaries (stdlib + msgspec only).

Every other rlt package depends on this one and on no other rlt package; concrete parts are
wired together in `services/`.
"""

from rlt_contracts.attention import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionRequirements,
    KVCacheTensors,
    PagedAttentionBatch,
    UnmetRequirement,
    unmet_requirements,
)
from rlt_contracts.client import BatchSubmitter, EngineClient
from rlt_contracts.errors import (
    CapacityError,
    ConfigurationError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RltError,
)
from rlt_contracts.execution import (
    ExecutionFailure,
    FailedOperation,
    GeneratedTokens,
    ModelRunnerOutput,
    PrefillProgress,
)
from rlt_contracts.kv import (
    NO_PREFIX,
    AdmissionPlan,
    BlockTableUpdate,
    KVCapacity,
    KVLayout,
    KVPort,
    PrefixMatch,
)
from rlt_contracts.model import (
    LayerAttention,
    LogitsAdjustments,
    LoopedLanguageModel,
    LoopedModelShape,
    SampledRows,
    SamplingMode,
    TokenSampler,
)
from rlt_contracts.outputs import (
    EngineRequest,
    EngineStats,
    ModelInfo,
    RequestOutputDelta,
    RequestTimings,
)
from rlt_contracts.pd import (
    HandoffEvents,
    HandoffTarget,
    KVHandoffPort,
    KVTransferParams,
    PDCompatibility,
    PDRole,
)
from rlt_contracts.pd_wire import InstanceInfo, InstanceLoad, PDControl, PDIncompatibleError
from rlt_contracts.requests import ExecutionIdentity, FinishReason, RequestStage
from rlt_contracts.sampling import SamplingParams, SamplingRow
from rlt_contracts.scheduling import (
    DecodeRule,
    ExitRule,
    ExitRuleKind,
    NewRequestData,
    PrefillChunk,
    RequestBlocks,
    SchedulerOutput,
)
from rlt_contracts.structured import (
    ConstraintCompiler,
    StructuredOutput,
    StructuredOutputKind,
    TokenConstraint,
    TokenMask,
)

__all__ = [
    "TokenMask",
    "TokenConstraint",
    "StructuredOutputKind",
    "StructuredOutput",
    "ConstraintCompiler",
    "NO_PREFIX",
    "AdmissionPlan",
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionRequirements",
    "BatchSubmitter",
    "BlockTableUpdate",
    "CapacityError",
    "ConfigurationError",
    "DecodeRule",
    "EngineClient",
    "EngineDeadError",
    "EngineRequest",
    "EngineStats",
    "ExecutionFailure",
    "ExecutionIdentity",
    "ExitRule",
    "ExitRuleKind",
    "FailedOperation",
    "FinishReason",
    "GeneratedTokens",
    "HandoffEvents",
    "HandoffTarget",
    "InvalidRequestError",
    "KVCacheTensors",
    "KVCapacity",
    "KVLayout",
    "KVPort",
    "KVHandoffPort",
    "KVTransferParams",
    "LayerAttention",
    "LogitsAdjustments",
    "LoopedLanguageModel",
    "LoopedModelShape",
    "ModelInfo",
    "ModelRunnerOutput",
    "NewRequestData",
    "OverloadedError",
    "PDCompatibility",
    "PDRole",
    "InstanceInfo",
    "InstanceLoad",
    "PDControl",
    "PDIncompatibleError",
    "PagedAttentionBatch",
    "PrefillChunk",
    "PrefillProgress",
    "PrefixMatch",
    "RequestBlocks",
    "RequestOutputDelta",
    "RequestTimings",
    "RequestStage",
    "RltError",
    "SampledRows",
    "SamplingMode",
    "SamplingParams",
    "SamplingRow",
    "SchedulerOutput",
    "TokenSampler",
    "UnmetRequirement",
    "unmet_requirements",
]
