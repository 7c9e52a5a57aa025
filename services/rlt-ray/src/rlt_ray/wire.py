"""What an engine replica's `generate` stream yields to the ingress, besides the deltas.

    ingress                                   replica
    generate.remote(EngineRequest) ------->   submit to its engine
    <-------- Accepted(replica, stats)        (or Rejected(WireError): the engine refused it)
    <-------- RequestOutputDelta ...          the engine's own deltas, unchanged
    <-------- RequestOutputDelta(finished)    then the stream ends
    <-------- Finished(stats)

The first item answers the submit: the ingress's `submit` returns or raises the engine's own
error (`rlt_contracts.raise_wire_error`) before any token is read, as on a single engine.
Everything is a msgspec struct; Ray pickles them across processes.
"""

from __future__ import annotations

import msgspec
from rlt_contracts import EngineStats, WireError


class Accepted(msgspec.Struct, frozen=True):
    replica: str  # the replica's id (Ray's replica tag): names it in errors and stats
    stats: EngineStats


class Rejected(msgspec.Struct, frozen=True):
    error: WireError


class Finished(msgspec.Struct, frozen=True):
    stats: EngineStats


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The fleet as one engine: counters and gauges added up (per-position speculation
    counters elementwise), how it executes taken from the first replica."""
    if not stats:
        return EngineStats()
    fields = {}
    for name in EngineStats.__struct_fields__:
        values = [getattr(s, name) for s in stats]
        first = values[0]
        if isinstance(first, bool) or isinstance(first, str):
            fields[name] = first
        elif isinstance(first, int):
            fields[name] = sum(values)
        elif isinstance(first, tuple):
            width = max(len(v) for v in values)
            fields[name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            fields[name] = first
    return EngineStats(**fields)
