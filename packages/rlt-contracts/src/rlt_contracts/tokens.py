"""Per-token results as aligned columns: one definition from the runner's read-back to the API.

`TokenColumns` is the one place a generated token's per-token fields are declared. The
runner's `GeneratedTokens`, the core's `RequestOutputDelta` and the front end's outputs carry
these columns by inheritance or through a `TokenLog`, and copy them generically (by the names
`COLUMNS` lists), so a new per-token field is added here, filled where it is read back
(rlt_runner/readback.py) and rendered where the API declares it (rlt_serve's response schemas);
every layer in between passes it on unchanged.

A column is either always present (a tuple aligned with token_ids) or optional: None unless the
request asked for it (`requested_columns`), then aligned as well.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from rlt_contracts.sampling import SamplingParams


class TokenColumns(msgspec.Struct, frozen=True, kw_only=True):
    """Consecutive output tokens of one request, one aligned tuple per per-token field.

    exit_depths[i]: loops the hidden state that produced token_ids[i] went through.
    logprobs: per token, its log-probability under the model's raw distribution (log_softmax of
      the logits in fp32, before temperature / top-k / top-p); None if the request asked for none.
    top_logprobs: per token, the requested number of most likely (token_id, logprob) pairs, most
      likely first; None if the request asked for no logprobs.
    """

    token_ids: tuple[int, ...] = ()
    exit_depths: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


COLUMNS: tuple[str, ...] = TokenColumns.__struct_fields__
# columns that are None unless the request asked for them
OPTIONAL_COLUMNS: frozenset[str] = frozenset(
    field.name for field in msgspec.structs.fields(TokenColumns) if field.default is None
)


def requested_columns(sampling: SamplingParams) -> frozenset[str]:
    """The optional columns a request's options ask for."""
    return frozenset({"logprobs", "top_logprobs"}) if sampling.logprobs is not None else frozenset()


def columns_of(tokens: TokenColumns, start: int = 0, end: int | None = None) -> dict[str, object]:
    """`tokens`' columns over [start, end), as keyword arguments for any `TokenColumns` type."""
    return {
        name: None if (values := getattr(tokens, name)) is None else tuple(values[start:end])
        for name in COLUMNS
    }


class TokenLog:
    """One request's columns as growing lists (the attributes are named as in `TokenColumns`);
    an optional column the request did not ask for stays None.

    Appending copies every column by name, so the owners of a log (the scheduler's request,
    the front end's output, the API's choice) never name a per-token field to pass it on.
    """

    __slots__ = COLUMNS
    if TYPE_CHECKING:  # the columns, typed for readers (at run time: COLUMNS' slots)
        token_ids: list[int]
        exit_depths: list[int]
        logprobs: list[float | None] | None
        top_logprobs: list[tuple[tuple[int, float], ...] | None] | None

    def __init__(self, optional: Iterable[str] = ()) -> None:
        enabled = frozenset(optional)
        unknown = enabled - OPTIONAL_COLUMNS
        if unknown:
            raise ValueError(f"not optional token columns: {sorted(unknown)}")
        for name in COLUMNS:
            setattr(self, name, [] if name not in OPTIONAL_COLUMNS or name in enabled else None)

    @classmethod
    def for_request(cls, sampling: SamplingParams) -> TokenLog:
        return cls(requested_columns(sampling))

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, tokens: TokenColumns, start: int = 0, end: int | None = None) -> None:
        """Append tokens [start, end) of `tokens` (an optional column it lacks is padded with
        None entries where this log keeps it, so the columns stay aligned)."""
        count = len(tokens.token_ids[start:end])
        for name in COLUMNS:
            column = getattr(self, name)
            if column is None:
                continue
            values = getattr(tokens, name)
            column.extend((None,) * count if values is None else values[start:end])

    def since(self, start: int = 0, end: int | None = None) -> dict[str, object]:
        """Columns over [start, end) as keyword arguments for any `TokenColumns` type."""
        return columns_of(self, start, end)  # type: ignore[arg-type]


class TokenLogColumns:
    """Mixin for a holder of a `tokens: TokenLog` (the front end's `RequestOutput`, the API's
    choice): every column is also a read-only attribute of the holder (`output.exit_depths` is
    `output.tokens.exit_depths`), a new column included."""

    __slots__ = ()
    tokens: TokenLog
    if TYPE_CHECKING:  # as TokenLog's (at run time: properties made from COLUMNS below)
        token_ids: list[int]
        exit_depths: list[int]
        logprobs: list[float | None] | None
        top_logprobs: list[tuple[tuple[int, float], ...] | None] | None


def _column(name: str) -> property:
    return property(lambda holder: getattr(holder.tokens, name), doc=f"`tokens.{name}`")


for _name in COLUMNS:
    setattr(TokenLogColumns, _name, _column(_name))
