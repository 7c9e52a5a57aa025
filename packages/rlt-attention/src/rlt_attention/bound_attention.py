"""The layer call every backend's bound attention shares: check the inputs and the window, then
the backend's store and read (`_run`); `StoreThenAttend` stores the call's keys/values at their
write slots with `kv_store.store_kv`, then attends (`_attend`, the backend's math)."""

from __future__ import annotations

import torch
from rlt_contracts import PagedAttentionBatch

from rlt_attention.batch_shape import BatchShape, check_layer_inputs, check_window
from rlt_attention.kv_store import SlotViews, store_kv


class BoundAttention:
    """A `LayerAttention` valid for one call: it borrows the KV views and the batch metadata."""

    def __init__(self, views: SlotViews, batch: PagedAttentionBatch, shape: BatchShape) -> None:
        self._views = views
        self._batch = batch
        self._shape = shape

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """`rlt_contracts.LayerAttention`: query [N, H, D], key/value [N, Hkv, D] -> output
        [N, H, D] in query's dtype (`window`: a sliding-window layer's W, or None)."""
        check_layer_inputs(self._views, self._shape.num_rows, query, key, value)
        window = check_window(window, self._batch, self._shape.max_context_len)
        return self._run(layer_index, query, key, value, window)

    def _run(self, layer_index: int, query, key, value, window: int | None) -> torch.Tensor:
        raise NotImplementedError


class StoreThenAttend(BoundAttention):
    def _run(self, layer_index: int, query, key, value, window: int | None) -> torch.Tensor:
        store_kv(self._views, layer_index, self._batch.write_slots, key, value)
        if self._shape.num_rows == 0:
            return torch.empty_like(query)
        return self._attend(layer_index, query, window)

    def _attend(self, layer_index: int, query: torch.Tensor, window: int | None) -> torch.Tensor:
        raise NotImplementedError
