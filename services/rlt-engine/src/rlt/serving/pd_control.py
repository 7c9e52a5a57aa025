"""`EnginePDControl`: the `rlt_contracts.PDControl` of one PD engine instance (what its
/internal/pd/* endpoints need besides the `EngineClient`).

The transport belongs to the engine core, so `connect` is a core call (`CorePDConnect`,
answered between two steps); `info` only reads what the core reported when it started
(`PDStaticInfo`) and the latest statistics.
"""

from __future__ import annotations

import base64

from rlt_contracts import (
    InstanceInfo,
    InstanceLoad,
    PDIncompatibleError,
    PDRole,
    PDStaticInfo,
    RltError,
)

from rlt.serving.core_client import CoreClient


class PDConnectError(RltError, RuntimeError):
    """The transport could not open a connection to a compatible peer."""


class EnginePDControl:
    def __init__(self, client: CoreClient, pd: PDStaticInfo | None) -> None:
        self._client = client
        self._pd = pd
        self._metadata = base64.b64encode(pd.metadata).decode() if pd is not None else ""

    @property
    def role(self) -> PDRole:
        return self._pd.role if self._pd is not None else PDRole.NONE

    def info(self) -> InstanceInfo:
        stats = self._client.stats()
        pd = self._pd
        return InstanceInfo(
            role=self.role,
            agent=pd.agent if pd is not None else "",
            metadata=self._metadata,
            compatibility=pd.compatibility if pd is not None else None,
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
        if self._pd is None:
            raise PDIncompatibleError("this instance has PD role none: it has no transport")
        connected, incompatible, failed = await self._client.pd_connect(peers)
        if incompatible:
            raise PDIncompatibleError("; ".join(incompatible))
        if failed:
            raise PDConnectError("; ".join(failed))
        return connected
