"""`LogitsState`: the per-row [S, V]-sized state of the logits adjustments (M5).

`DecodeRows` owns one and writes it when rows are activated; the decode program reads it through
`DecodeRows.adjustments` and counts outputs into it; `SnapshotStore` saves and restores the part
of a row that activation does not rewrite. The per-row adjustment scalars (repetition /
frequency / presence penalty, min_tokens) are not here: `DecodeRows` uploads them with the rest
of a row's parameters.

Lazily allocated, once, when the first request that needs them gets a row (then kept for the
runner's life, so CUDA graphs that read them stay valid); until then None. README.md says who
writes each ("Responsibility and state") and gives their sizes ("Snapshots and memory"):
  output_counts [S, V] int32   occurrences of each token in the row's outputs (penalties)
  prompt_mask [S, V] bool      the token occurs in the whole prompt (repetition_penalty)
  bias_token_ids, bias_values [S, K = 300]: the logit_bias entries, padded with (0, 0.0)
  stop_mask [S, V] bool        the rule's stop ids and the model's EOS ids, also under
                               ignore_eos (vLLM's all_stop_token_ids): min_tokens masks them
  token_bitmask [S, ceil(V / 32)] int32: structured output's allowed tokens (-1 words: all)
Rows of requests that do not use a feature keep stale values there; their neutral scalars
(penalties 1 / 0 / 0, min_tokens 0) make them inert.
"""

from __future__ import annotations

import torch
from rlt_contracts.sampling import MAX_LOGIT_BIAS

from rlt_runner.row_record import RowRecord
from rlt_runner.transfers import download, upload


class LogitsState:
    def __init__(
        self,
        *,
        max_rows: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        # min_tokens masks the model's EOS ids even under ignore_eos (vLLM's all_stop_token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.bias_token_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.stop_mask: torch.Tensor | None = None
        self.token_bitmask: torch.Tensor | None = None

    # -- activation ----------------------------------------------------------------------------
    def write_adjustments(self, records: list[RowRecord], index: torch.Tensor) -> None:
        """The [S, V] / [S, K] state of the adjustments the new rows use (allocated on first
        use): prompt mask and zero counts of penalized rows, logit_bias entries of every new row
        once the table exists, stop mask of min_tokens rows. One upload per group. `index`: the
        records' rows on the device, in order. PD prefill rows never sample here: they get none
        of it (their stale table rows are never read)."""
        sampling = [r for r in records if not r.prefill_only]
        if len(sampling) < len(records):
            if not sampling:
                return
            records = sampling
            index = upload([r.row for r in records], torch.int64, self.device)
        penalized = [r for r in records if r.sampling.penalized]
        if penalized:
            counts, prompt = self._penalty_tensors()
            rows = upload([r.row for r in penalized], torch.int64, self.device)
            counts.index_fill_(0, rows, 0)
            prompt.index_fill_(0, rows, False)
            self._set_tokens(prompt, [(r.row, r.prompt_token_ids) for r in penalized])
        if self.bias_token_ids is not None or any(r.sampling.logit_bias for r in records):
            ids, values = self._bias_tensors()
            entries = [sorted((r.sampling.logit_bias or {}).items()) for r in records]
            padded = [e + [(0, 0.0)] * (MAX_LOGIT_BIAS - len(e)) for e in entries]
            ids.index_copy_(
                0, index, upload([[t for t, _ in e] for e in padded], torch.int64, self.device)
            )
            values.index_copy_(
                0,
                index,
                upload([[b for _, b in e] for e in padded], torch.float64, self.device).float(),
            )
        limited = [r for r in records if r.sampling.min_tokens > 0]
        if limited:
            stop_mask = self._stop_mask()
            stop_mask.index_fill_(0, upload([r.row for r in limited], torch.int64, self.device), 0)
            self._set_tokens(
                stop_mask,
                [(r.row, (*r.rule.stop_token_ids, *self.eos_token_ids)) for r in limited],
            )

    def reset_token_masks(self, records: list[RowRecord], index: torch.Tensor) -> None:
        """Every new row allows every token until a mask comes (once the bitmask exists, or
        when one of the records is the first structured request)."""
        # a structured request without a grammar here (PD prefill) still selects the mode
        if self.token_bitmask is not None or any(
            r.sampling.structured_output is not None for r in records
        ):
            self._bitmask().index_fill_(0, index, -1)

    def _set_tokens(self, mask: torch.Tensor, rows: list[tuple[int, tuple[int, ...]]]) -> None:
        pairs = [(row, token) for row, tokens in rows for token in tokens]
        if pairs:
            flat = upload(
                [row * self.vocab_size + token for row, token in pairs], torch.int64, self.device
            )
            mask.view(-1).index_fill_(0, flat, True)

    # -- lazy allocation -----------------------------------------------------------------------
    def _penalty_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None:
            shape = (self.max_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def _bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bias_token_ids is None:
            shape = (self.max_rows, MAX_LOGIT_BIAS)
            self.bias_token_ids = torch.zeros(shape, dtype=torch.int64, device=self.device)
            self.bias_values = torch.zeros(shape, dtype=torch.float32, device=self.device)
        return self.bias_token_ids, self.bias_values

    def _stop_mask(self) -> torch.Tensor:
        if self.stop_mask is None:
            shape = (self.max_rows, self.vocab_size)
            self.stop_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.stop_mask

    def _bitmask(self) -> torch.Tensor:
        if self.token_bitmask is None:
            shape = (self.max_rows, -(-self.vocab_size // 32))
            self.token_bitmask = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        return self.token_bitmask

    # -- decode-time writes --------------------------------------------------------------------
    def count_outputs(
        self, index: torch.Tensor, token_ids: torch.Tensor, counted: torch.Tensor
    ) -> None:
        """output_counts[index[n], token_ids[n]] += counted[n] (int or bool [n]); the rows are
        distinct, so the flat slots are too (an index_add, no host sync). A no-op until a
        penalized request allocated the counts."""
        if self.output_counts is not None:
            slots = index * self.vocab_size + token_ids
            self.output_counts.view(-1).index_add_(0, slots, counted.to(torch.int32))

    def write_token_masks(self, masks: list[tuple[int, bytes]]) -> torch.Tensor:
        """Write each (row, next-token bitmask as little-endian int32 words) into the bitmask
        (allocated on first use) with one pinned upload. Returns the rows' device index."""
        bitmask = self._bitmask()
        words = bitmask.shape[1]
        host = torch.frombuffer(bytearray(b"".join(m for _, m in masks)), dtype=torch.int32)
        if host.numel() != words * len(masks):
            raise ValueError(f"token masks must have {words} int32 words per row")
        host = host.view(len(masks), words)
        if self.device.type == "cuda":
            host = host.pin_memory()
        index = upload([row for row, _ in masks], torch.int64, self.device)
        bitmask.index_copy_(0, index, host.to(self.device, non_blocking=True))
        return index

    # -- snapshots -----------------------------------------------------------------------------
    def save_row(self, record: RowRecord) -> dict[str, torch.Tensor]:
        """Host copies ([1, ...], queued like `download`) of the record's row state that
        activation does not rewrite: its output counts if penalized, its token bitmask if
        structured (the mask it may sample under). A PD prefill row never samples here, so it
        has none (and the tensors may not even exist on a prefill instance)."""
        if record.prefill_only:
            return {}
        names: tuple[str, ...] = ()
        if record.sampling.penalized:
            names += ("output_counts",)
        if record.rule.one_output_per_step:
            names += ("token_bitmask",)
        return {name: download(getattr(self, name)[record.row : record.row + 1]) for name in names}

    def restore_row(self, row: int, saved: dict[str, torch.Tensor]) -> None:
        """Queue the copies of `save_row`'s host tensors into `row` (after its activation)."""
        for name, tensor in saved.items():
            getattr(self, name)[row : row + 1].copy_(tensor, non_blocking=True)
