"""PD wiring of one engine (M9): its NIXL transport over the memory the runner declares, the
handoff port of its role, and the `PDLink` the engine core is built with.

Registered memory: what the runner's `PDMemorySource` declares for the role
(`rlt_contracts.PDMemory`): the whole KV pool (every plane's blocks, the stage plane's too; the
scratch blocks are never a target) and the role's hidden rows (P: the rows' state, read for the
final prompt state; D: the landing buffer). Nothing here reads the runner's tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from rlt_contracts import PDCompatibility, PDMemory, PDMemorySource, PDRole, PDStaticInfo
from rlt_kv import KVCacheManager
from rlt_pd import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_TRANSFER_CHUNK_BYTES,
    KVTransport,
    ReceiverConfig,
    SenderConfig,
    TransportHandoffPort,
)
from rlt_scheduler import Scheduler

from rlt.engine.config import EngineConfig
from rlt.engine.pd_link import HandoffPortFactory, PDLink


@dataclass(frozen=True)
class PDParts:
    role: PDRole
    agent: str
    transport: KVTransport
    port: TransportHandoffPort
    compatibility: PDCompatibility
    metadata: bytes  # the transport's handshake metadata (fixed once memory is registered)

    def static_info(self) -> PDStaticInfo:
        """What front ends need once (they live in another thread or process)."""
        return PDStaticInfo(self.role, self.agent, self.metadata, self.compatibility)


def model_identity(model_dir: Path) -> str:
    """Digest of the checkpoint's config and its weight files' names and sizes: equal on two
    instances that loaded the same checkpoint (cheap: the weights are not read)."""
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return f"{model_dir.name}:{digest.hexdigest()[:16]}"


def agent_name(role: PDRole) -> str:
    """Unique per process start (a restarted instance gets a new name, which is how peers and
    the coordinator tell a restart from a slow answer)."""
    return f"rlt-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def default_max_inflight_bytes(max_num_batched_tokens: int, kv_bytes_per_token: int) -> int:
    """P's default bound on posted, unfinished KV writes: twice the KV one step can compute
    (`kv_bytes_per_token`: K and V of every layer at every plane), at least 256 MiB.

    P posts a step's chunks once its results are collected, while the next step computes, so
    the bound must hold one step's KV with room for the previous step's writes still
    finishing. A smaller bound caps the handoff rate at the bound per step whatever the link
    does: 256 MiB is two thirds of one 512-token prompt of Ouro-1.4B (768 KiB per token), and
    such a P pushed one prompt per ~1.5 steps while its requests queued behind each other.
    """
    return max(DEFAULT_MAX_INFLIGHT_BYTES, 2 * max_num_batched_tokens * kv_bytes_per_token)


def build_pd(
    config: EngineConfig,
    model_dir: Path,
    scheduler: Scheduler,
    kv: KVCacheManager,
    rows: PDMemorySource,
    *,
    handoff_port: HandoffPortFactory | None = None,
) -> tuple[PDLink, PDParts | None]:
    """The PD part of a prefill or decode instance: a new NIXL agent registers the memory the
    runner declares (`rows`) and the link drives its port (PDParts: transport and port); with
    `handoff_port`, the port it makes over that memory (no PDParts)."""
    role = config.pd.role
    memory = rows.memory(role)
    agent = agent_name(role)
    parts = None
    if handoff_port is not None:
        port = handoff_port(role, memory)
    else:
        parts = nixl_parts(config, model_dir, memory, agent, scheduler.model_depth, owner=rows)
        port = parts.port
    return PDLink(role, port, scheduler, rows, kv, agent_name=agent), parts


def nixl_parts(
    config: EngineConfig,
    model_dir: Path,
    memory: PDMemory,
    agent: str,
    model_depth: int,
    *,
    owner: object,
) -> PDParts:
    """Register `memory` (kept allocated by `owner`) with NIXL agent `agent`; its port."""
    role, pool, pd = config.pd.role, memory.kv, config.pd
    compatibility = PDCompatibility(
        model_identity=model_identity(model_dir),
        num_layers=pool.num_layers,
        num_loops=model_depth,
        kv_layout=config.runner.layout.value,  # canonical ("ring:8", never "ring:08")
        dtype=pool.dtype,
        block_size=pool.block_size,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        block_bytes=2 * pool.block_bytes,
        hidden_bytes=memory.hidden.row_bytes,
        kv_cache_dtype=pool.dtype,
        kv_scales=pool.scales,
    )
    transport = KVTransport(agent, memory, compatibility, owner=owner)
    max_inflight = pd.max_inflight_bytes
    if max_inflight is None:
        kv_bytes_per_token = 2 * pool.token_bytes * pool.num_layers * pool.num_planes
        max_inflight = default_max_inflight_bytes(
            config.scheduler.max_num_batched_tokens, kv_bytes_per_token
        )
    chunk_bytes = min(DEFAULT_TRANSFER_CHUNK_BYTES, max_inflight)
    port = TransportHandoffPort(
        role,
        transport,
        sender_config=SenderConfig(
            max_inflight_bytes=max_inflight,
            transfer_chunk_bytes=chunk_bytes,
            write_timeout_s=pd.write_timeout_s,
        ),
        receiver_config=ReceiverConfig(wait_timeout_s=pd.kv_timeout_s, lease_s=pd.kv_lease_s),
    )
    return PDParts(role, agent, transport, port, compatibility, transport.metadata())
