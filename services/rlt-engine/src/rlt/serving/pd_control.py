"""`EnginePDControl`: the `rlt_contracts.PDControl` of one PD engine instance (what its
/internal/pd/* endpoints need besides the `EngineClient`).

The transport belongs to the engine thread, so `connect` runs there (`AsyncEngine.call`),
between two steps; `info` only reads values fixed at start-up and the published statistics.
"""

from __future__ import annotations

import base64

from rlt_contracts import InstanceInfo, InstanceLoad, PDIncompatibleError, PDRole, RltError
from rlt_pd import PDCompatibilityError

from rlt.engine.llm_engine import LLMEngine
from rlt.engine.pd_assembly import PDParts
from rlt.serving.async_engine import AsyncEngine


class PDConnectError(RltError, RuntimeError):
    """The transport could not open a connection to a compatible peer."""


class EnginePDControl:
    def __init__(self, client: AsyncEngine, parts: PDParts | None) -> None:
        self._client = client
        self._parts = parts
        self._metadata = base64.b64encode(parts.metadata).decode() if parts is not None else ""

    @property
    def role(self) -> PDRole:
        return self._parts.role if self._parts is not None else PDRole.NONE

    def info(self) -> InstanceInfo:
        stats = self._client.stats()
        parts = self._parts
        return InstanceInfo(
            role=self.role,
            agent=parts.agent if parts is not None else "",
            metadata=self._metadata,
            compatibility=parts.compatibility if parts is not None else None,
            load=InstanceLoad(
                running=stats.running_requests,
                waiting=stats.waiting_requests,
                kv_blocks_free=stats.kv_blocks_total - stats.kv_blocks_used,
                kv_blocks_total=stats.kv_blocks_total,
            ),
        )

    async def connect(self, peers: list[bytes]) -> list[str]:
        """Connect every compatible peer; raises PDIncompatibleError naming each refused one
        (the compatible ones stay connected)."""
        if self._parts is None:
            raise PDIncompatibleError("this instance has PD role none: it has no transport")
        transport = self._parts.transport

        def connect_all(_engine: LLMEngine) -> tuple[list[str], list[str], list[str]]:
            connected, incompatible, failed = [], [], []
            for metadata in peers:
                try:
                    connected.append(transport.connect(metadata))
                except PDCompatibilityError as error:
                    incompatible.append(str(error))
                except RltError as error:
                    failed.append(str(error))
            return connected, incompatible, failed

        connected, incompatible, failed = await self._client.call(connect_all)
        if incompatible:
            raise PDIncompatibleError("; ".join(incompatible))
        if failed:
            raise PDConnectError("; ".join(failed))
        return connected
