"""`RequestTable`: the requests of an `EngineClient` that forwards them elsewhere (the PD
coordinator's, Ray's ingress), by request id, with the contract's checks on ids."""

from __future__ import annotations

from typing import TypeVar

from rlt_contracts import InvalidRequestError

F = TypeVar("F")  # the client's own per-request record: has `finished` and `claimed`


class RequestTable(dict[str, F]):
    def check_free(self, request_id: str) -> None:
        """`submit`'s check: the id may not name a request still in flight."""
        existing = self.get(request_id)
        if existing is not None and not existing.finished:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already in flight")

    def claim(self, request_id: str) -> F:
        """`stream`'s check: a submitted request is streamed once."""
        entry = self.get(request_id)
        if entry is None or entry.claimed:
            raise InvalidRequestError(
                "request_id", f"no submitted, unclaimed request {request_id!r} to stream"
            )
        entry.claimed = True
        return entry

    def forget(self, request_id: str, entry: F) -> None:
        """Remove `entry`, unless its id names another request by now (the id was reused)."""
        if self.get(request_id) is entry:
            del self[request_id]
