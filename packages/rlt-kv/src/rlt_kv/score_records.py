"""`ScoreRecords`: the prompt scores of cached prompt pages, host memory bounded in bytes
(README.md, "Score records and salted pages"). A record holds one page's `PageScores`, keyed
by (page key, next token), packed in typed arrays (exact); it goes with its page and, past
`max_bytes`, least recently used first. State owned here, written only through `PrefixCache`
/ `KVCacheManager`: the packed records, their LRU order, the per-page index and the byte count.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from rlt_contracts import PageScores

PageKey = bytes
# 16 positions with top-1 take 16 * (8 + 4 + 4 + 8) = 384 bytes: 64 MiB keep ~170k such pages
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Packed:
    """One `PageScores` in typed arrays (exact: log-probabilities stay float64)."""

    top_n: int
    logprobs: array  # 'd' [positions]
    ranks: array  # 'i' [positions]
    top_ids: array  # 'i' [positions * top_n]
    top_logprobs: array  # 'd' [positions * top_n]
    exit_depths: array  # 'i' [positions] or empty

    @classmethod
    def of(cls, scores: PageScores) -> _Packed:
        return cls(
            scores.top_n,
            array("d", scores.token_logprobs),
            array("i", scores.token_ranks),
            array("i", [token for top in scores.top_logprobs for token, _ in top]),
            array("d", [logprob for top in scores.top_logprobs for _, logprob in top]),
            array("i", scores.exit_depths),
        )

    @property
    def num_bytes(self) -> int:
        arrays = (self.logprobs, self.ranks, self.top_ids, self.top_logprobs, self.exit_depths)
        return sum(a.itemsize * len(a) for a in arrays)

    def unpack(self) -> PageScores:
        n = self.top_n
        return PageScores(
            top_n=n,
            token_logprobs=tuple(self.logprobs),
            token_ranks=tuple(self.ranks),
            top_logprobs=tuple(
                tuple(
                    zip(
                        self.top_ids[i * n : (i + 1) * n],
                        self.top_logprobs[i * n : (i + 1) * n],
                        strict=True,
                    )
                )
                for i in range(len(self.logprobs))
            ),  # fmt: skip
            exit_depths=tuple(self.exit_depths),
        )


class ScoreRecords:
    """(page key, next token) -> packed `PageScores`, least recently used first."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._records: OrderedDict[tuple[PageKey, int], _Packed] = OrderedDict()
        self._next_tokens: dict[PageKey, set[int]] = {}  # page key -> next tokens recorded

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: PageKey, next_token: int, top_n: int) -> PageScores | None:
        """The record of `key` followed by `next_token` if it has >= `top_n` alternatives.
        Pure: the LRU order changes only through `touch`."""
        packed = self._records.get((key, next_token))
        if packed is None or packed.top_n < top_n:
            return None
        return packed.unpack()

    def put(self, key: PageKey, next_token: int, scores: PageScores) -> None:
        """Keep `scores` unless a record with at least as many alternatives is there (a request
        asking for more alternatives replaces a smaller record); then trim to `max_bytes`."""
        slot = (key, next_token)
        old = self._records.get(slot)
        if old is not None:
            if old.top_n >= scores.top_n:
                self._records.move_to_end(slot)
                return
            self._remove(slot)
        packed = _Packed.of(scores)
        if packed.num_bytes > self.max_bytes:
            return
        self._records[slot] = packed
        self._next_tokens.setdefault(key, set()).add(next_token)
        self.num_bytes += packed.num_bytes
        while self.num_bytes > self.max_bytes:
            self._remove(next(iter(self._records)))

    def touch(self, key: PageKey) -> None:
        """Mark the page's records as just used (a request reused them)."""
        for next_token in self._next_tokens.get(key, ()):
            self._records.move_to_end((key, next_token))

    def drop_page(self, key: PageKey) -> None:
        """Forget every record of a page whose KV left the cache."""
        for next_token in list(self._next_tokens.get(key, ())):
            self._remove((key, next_token))

    def clear(self) -> None:
        self._records.clear()
        self._next_tokens.clear()
        self.num_bytes = 0

    def _remove(self, slot: tuple[PageKey, int]) -> None:
        self.num_bytes -= self._records.pop(slot).num_bytes
        key, next_token = slot
        tokens = self._next_tokens[key]
        tokens.discard(next_token)
        if not tokens:
            del self._next_tokens[key]
