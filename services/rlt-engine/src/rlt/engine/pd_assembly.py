"""PD wiring of one engine (M9): its NIXL transport over the runner's tensors, the handoff port
of its role, and the `PDLink` that joins them to the engine core.

Registered memory: the runner's whole key and value caches (every plane's blocks live in them;
the scratch block is never a target) and one [S, d] hidden-state tensor: on a prefill
instance the rows' `hidden` (the final prompt state is read from P's row), on a decode
instance the rows' `landing` buffer (decode ticks rewrite `hidden`; the engine copies the
landed state into it when the request starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from rlt_contracts import PDCompatibility, PDRole, PDStaticInfo
from rlt_pd import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_TRANSFER_CHUNK_BYTES,
    KVTransport,
    ReceiverConfig,
    SenderConfig,
    TransportHandoffPort,
)

from rlt.engine.config import EngineConfig
from rlt.engine.core import EngineCore
from rlt.engine.pd_link import PDLink


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


def attach_pd(core: EngineCore, config: EngineConfig, model_dir: Path) -> PDParts:
    """Register the runner's memory with a new NIXL agent and give the core its PD link."""
    role = config.role
    runner = core.runner
    keys, values = runner.kv.tensors.key_cache, runner.kv.tensors.value_cache
    hidden = runner.rows.hidden if role is PDRole.PREFILL else runner.rows.landing
    num_layers, _, block_size, heads, head_dim = keys.shape
    element = keys.element_size()
    compatibility = PDCompatibility(
        model_identity=model_identity(model_dir),
        num_layers=num_layers,
        num_loops=core.scheduler.model_depth,
        kv_layout=config.layout.value,  # canonical ("ring:8", never "ring:08")
        dtype=str(keys.dtype).removeprefix("torch."),
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        block_bytes=2 * block_size * heads * head_dim * element,
        hidden_bytes=hidden.shape[1] * hidden.element_size(),
        kv_cache_dtype=str(keys.dtype).removeprefix("torch."),
        kv_scales=runner.kv.scales_tuple(),
    )
    agent = agent_name(role)
    transport = KVTransport(agent, keys, values, hidden, compatibility)
    max_inflight = config.pd_max_inflight_bytes
    if max_inflight is None:
        kv_bytes_per_token = compatibility.block_bytes // block_size * num_layers
        max_inflight = default_max_inflight_bytes(
            config.max_num_batched_tokens, kv_bytes_per_token * core.kv.num_planes
        )
    chunk_bytes = min(DEFAULT_TRANSFER_CHUNK_BYTES, max_inflight)
    port = TransportHandoffPort(
        role,
        transport,
        sender_config=SenderConfig(
            max_inflight_bytes=max_inflight,
            transfer_chunk_bytes=chunk_bytes,
            write_timeout_s=config.pd_write_timeout_s,
        ),
        receiver_config=ReceiverConfig(
            wait_timeout_s=config.pd_kv_timeout_s, lease_s=config.pd_kv_lease_s
        ),
    )
    core.pd = PDLink(role, port, core.scheduler, runner, core.kv, agent_name=agent)
    return PDParts(role, agent, transport, port, compatibility, transport.metadata())
