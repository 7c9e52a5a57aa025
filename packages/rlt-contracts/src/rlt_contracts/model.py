"""Model-side protocols: what the runner needs from a looped language model and its attention.

Tensors are torch tensors; they are typed `Any` here so this package stays free of torch.
Shapes use N = number of token rows in the call, d = hidden size, H / Hkv = query / KV heads,
D = head dim, V = vocabulary size. Rows are packed ("varlen"): there is no batch padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rlt_contracts.family import FamilyDeclaration

Tensor = Any


class LoopedModelShape(msgspec.Struct, frozen=True):
    """Static shape of a recurrent looped transformer (prelude -> T x recurrent -> coda).

    num_layers: KV layer slots of one loop's plane (the stack's layers; a block that runs its
      stack several times per loop keeps a slot per (pass, layer)).
    state_size (0.3.0): values of the state a loop carries per token (0: hidden_size, one
      vector; a family whose loops carry several vectors, e.g. two, declares 2 * hidden_size).
      `embed` returns and `recurrent_step` takes and returns [N, state_width]; `coda` reads it.
    """

    num_layers: int  # KV layer slots per loop plane (L)
    num_loops: int  # model depth T: loops applied per token at most
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    state_size: int = 0

    @property
    def state_width(self) -> int:
        return self.state_size or self.hidden_size


class LayerAttention(Protocol):
    """Attention of one model call, bound to the batch's KV metadata by the runner.

    Called once per physical layer per loop with post-RoPE `query` [N, H, D], `key` [N, Hkv, D]
    and `value` [N, Hkv, D] of the call's tokens. It stores key/value into the KV cache (where
    the call's metadata says) and returns the attention output [N, H, D] (softmax scale D^-0.5,
    causal over each row's visible context).

    window (0.3.1): a sliding-window layer's width W: a query at position p sees only keys at
    positions p - W + 1 .. p (transformers' `sliding_window`); None: the whole context. Only
    backends declaring `supports_sliding_window` accept it.
    """

    def __call__(
        self,
        layer_index: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        window: int | None = None,
    ) -> Tensor: ...


class LoopedLanguageModel(Protocol):
    """Prelude / recurrent step / coda split of a looped model (see ouro-model-spec.md 3.11).

    embed: prelude. token_ids [N] int64 -> hidden [N, d] in the model dtype.
    recurrent_step: one loop over all L layers plus the end-of-loop norm at fixed `positions`
      [N] int64. Returns the normed hidden state [N, d] (the next loop's input) and, when
      `compute_gate`, the exit-gate probability sigmoid(gate) [N] in fp32 (else None).
    coda: LM head. hidden [N, d] -> logits [N, V] (model dtype). `needed` (0.1.5, optional): a
      device int32 [1] flag the caller computed (e.g. "some row exits in this tick"); where it
      holds 0 no logit will be used, and the model may skip the head's work and return zeros.
      A hint: a model may always compute the logits. Never read on the host.

    Stage layers (0.3.1): a family whose prelude or coda layers attend (`family.kv.stage_layers`
    > 0) takes `positions` [N] int64 and `attention` (bound by the runner to the stage plane,
    writing where the row runs that stage and to the scratch slot elsewhere) in `embed` (the
    prelude), and has `finish(state, positions, attention) -> state`: the coda's layers on a
    token's state after its last loop, whose result `coda` (then the head alone) reads. Other
    families ignore both arguments and have no `finish`; the runner passes them and calls
    `finish` only for a family with stage layers. (0.4.0) In a decode tick the runner passes
    both stages `needed` too, with `coda`'s meaning: 0 when no row runs the stage in that tick.

    Random initial state (0.3.4): a family declaring `random_initial_state` takes `uniforms`
    [N, hidden_size] fp32 in (0, 1) in `embed` (`TokenSampler.state_uniforms` of the token's
    request seed and position) and draws its initial loop state from them; None: the zero state
    (the engine's `initial_state="zero"`).
    """

    shape: LoopedModelShape
    family: FamilyDeclaration  # (0.3.0) what the model's family declares (rlt_contracts.family)

    def embed(
        self,
        token_ids: Tensor,
        positions: Tensor | None = None,
        attention: LayerAttention | None = None,
        uniforms: Tensor | None = None,
        *,
        needed: Tensor | None = None,
    ) -> Tensor: ...

    def recurrent_step(
        self,
        hidden: Tensor,
        positions: Tensor,
        attention: LayerAttention,
        *,
        compute_gate: bool = True,
    ) -> tuple[Tensor, Tensor | None]: ...

    def coda(self, hidden: Tensor, *, needed: Tensor | None = None) -> Tensor: ...


class SamplingMode(msgspec.Struct, frozen=True):
    """Which sampling work a batch of rows needs (host flags, fixed per captured graph).

    A flag only selects work; the per-row values live in device tensors. A batch whose rows
    leave a feature at its neutral value launches none of its kernels.

    random: some row has temperature > 0 (Gumbel noise is drawn; greedy rows still take argmax).
    filtered: some random row uses top-k or top-p (one sort per batch).
    top_logprobs: None when no row wants logprobs; otherwise the number of alternatives
      computed for every row (each request keeps its own count of them).
    penalized: some row has a repetition, frequency or presence penalty (reads the rows'
      output counts and prompt mask, see `LogitsAdjustments`).
    biased: some row has a logit_bias.
    min_tokens: some row has min_tokens > 0 (its stop ids are masked while counter < min_tokens).
    min_p: some random row has min_p > 0 (one softmax per batch after temperature).
    constrained: some row has structured output: every row's allowed-token bitmask is applied
      to the raw logits first (rows without a grammar allow every token).
    """

    random: bool = False
    filtered: bool = False
    top_logprobs: int | None = None
    penalized: bool = False
    biased: bool = False
    min_tokens: bool = False
    min_p: bool = False
    constrained: bool = False

    @property
    def adjusts_logits(self) -> bool:
        """Some step before temperature runs (the logits are then copied to fp32 first)."""
        return self.penalized or self.biased or self.min_tokens or self.constrained


@dataclass(frozen=True)
class LogitsAdjustments:
    """Per-row device state read by the logits adjustments that precede temperature.

    Rows match the logits rows [N]; V = vocabulary size. Borrowed read-only by the sampler
    (views of the runner's persistent row buffers, or tensors `SamplingBatch.build` made).
    Each group is read only when its `SamplingMode` flag is set and may be None otherwise.

    penalized:
      output_counts [N, V] int32: occurrences of each token in the row's outputs so far.
      prompt_mask [N, V] bool: the token occurs in the row's prompt.
      repetition_penalty, frequency_penalty, presence_penalty [N] fp32 (1, 0, 0 neutral).
    biased:
      bias_token_ids [N, K] int64 and bias_values [N, K] fp32: added with a scatter-add;
        unused entries are (token 0, bias 0.0), which changes nothing. Ids are distinct
        within a row.
    min_tokens:
      min_tokens [N] int64: the stop mask applies while the sampled output index (the
        sampler's `counter`) is below it.
      stop_mask [N, V] bool: the row's stop token ids: the request's stop ids and the model's
        EOS ids, even under ignore_eos (vLLM's `all_stop_token_ids`).
    constrained:
      token_bitmask [N, ceil(V / 32)] int32: structured output's allowed tokens (bit t % 32 of
        word t // 32); -1 words for rows without a grammar.
    """

    output_counts: Tensor = None
    prompt_mask: Tensor = None
    repetition_penalty: Tensor = None
    frequency_penalty: Tensor = None
    presence_penalty: Tensor = None
    bias_token_ids: Tensor = None
    bias_values: Tensor = None
    min_tokens: Tensor = None
    stop_mask: Tensor = None
    token_bitmask: Tensor = None


class SampledRows(Protocol):
    """Device results of sampling N rows (nothing is read back by the sampler).

    token_ids [N] int64; logprobs [N] fp32, top_token_ids [N, k] int64 and top_logprobs [N, k]
    fp32 are None unless the mode asked for logprobs.
    """

    token_ids: Tensor
    logprobs: Tensor | None
    top_token_ids: Tensor | None
    top_logprobs: Tensor | None


class TokenSampler(Protocol):
    """logits [N, V] -> one token per row, each row with its own parameters and random stream.

    Per-row parameters are device tensors [N]: temperature fp32 (0 = greedy), top_k int64
    (<= 0 disabled), top_p fp32, seed int64, counter int64 (the output index being sampled: the
    row's position in its request's random stream; also what min_tokens compares with),
    min_p fp32 (needed when `mode.min_p`), and `adjustments` (needed when
    `mode.adjusts_logits`). Launches device work only (capturable in a CUDA graph for a fixed
    `mode`). Logprobs, when asked, are those of the raw logits.
    """

    def sample_rows(
        self,
        logits: Tensor,
        *,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        seed: Tensor,
        counter: Tensor,
        mode: SamplingMode,
        min_p: Tensor | None = None,
        adjustments: LogitsAdjustments | None = None,
    ) -> SampledRows: ...

    def state_uniforms(self, seed: Tensor, position: Tensor, width: int) -> Tensor:
        """(0.3.4) Uniforms fp32 [N, width] strictly inside (0, 1) for a family's random initial
        loop state: element [n, i] depends only on (seed[n], position[n], i), in a stream apart
        from token sampling's, so a token's draw never depends on its batch, on preemption or
        on which instance (PD) computes it."""
        ...


class ProposedRows(Protocol):
    """Device results of drafting one token for N rows (speculative decoding, 0.1.7).

    token_ids [N] int64: the drafted tokens; probabilities [N, V] fp32: the distribution each
    was drawn from (after the same adjustments, temperature and filters as `sample_rows`; None
    when no row is random: greedy drafts are argmaxes and need none).
    """

    token_ids: Tensor
    probabilities: Tensor | None


class VerifiedRows(Protocol):
    """Device results of verifying n rows' drafts (speculative decoding, 0.1.7).

    accepted [n] int64: drafts accepted (0 .. drafted); token_ids [n, K + 1] int64: the tokens
    the round emits, entries 0 .. accepted valid (the accepted drafts, then one token of the
    target distribution); logprobs [n, K + 1] fp32, top_token_ids / top_logprobs [n, K + 1, k]:
    of the RAW target logits at each position for the emitted token (None unless the mode asks
    for logprobs).
    """

    accepted: Tensor
    token_ids: Tensor
    logprobs: Tensor | None
    top_token_ids: Tensor | None
    top_logprobs: Tensor | None


class SpeculativeSampler(TokenSampler, Protocol):
    """A `TokenSampler` that also drafts and verifies (self-speculative decoding, 0.1.7).

    Per-row parameters are those of `sample_rows`, for n rows; `counter` [n] is the output index
    of each row's first position. Launches device work only (capturable for a fixed `mode`).

    propose_rows: one draft token per row at output index `counter`, from its own random stream
      (distinct from the target's), with the distribution it used.
    verify_rows: target_logits [n * (K + 1), V] are the rows' K + 1 positions in row-major order
      (position i is output index counter + i); draft_tokens [n, K] and draft_probabilities
      [n, K, V] (None if no row is random) come from `propose_rows`; drafted [n] int64 limits
      each row's drafts (0 .. K). Greedy rows accept a draft iff it equals the target's argmax;
      random rows by rejection sampling (accept with probability min(1, p/q), else draw from
      norm(max(p - q, 0))), so the emitted tokens follow the target distribution exactly. The
      token after the accepted drafts is the target's own sample at that output index when
      every draft was accepted (or none was drafted), which is then exactly what `sample_rows`
      would draw there. accepted_override [n] int64 (benchmarks only): take these accepted
      counts instead of testing the drafts.
    """

    def propose_rows(
        self,
        logits: Tensor,
        *,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        seed: Tensor,
        counter: Tensor,
        mode: SamplingMode,
        min_p: Tensor | None = None,
        adjustments: LogitsAdjustments | None = None,
    ) -> ProposedRows: ...

    def verify_rows(
        self,
        target_logits: Tensor,
        *,
        draft_tokens: Tensor,
        draft_probabilities: Tensor | None,
        drafted: Tensor,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        seed: Tensor,
        counter: Tensor,
        mode: SamplingMode,
        min_p: Tensor | None = None,
        adjustments: LogitsAdjustments | None = None,
        accepted_override: Tensor | None = None,
    ) -> VerifiedRows: ...
