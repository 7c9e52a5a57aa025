"""`EngineReplica`: one rlt engine in one Ray Serve replica (an actor process).

With `engine_process` (`--engine-process`) the engine runs as under `rlt serve`: its core is
a process of its own that this one starts and owns (`CoreProcess`, ZeroMQ, `CoreClient`), so
Ray's streaming of every chunk through this process never competes with the engine loop for
the GIL. Without it (the default), an `LLMEngine` whose core loop runs on a thread of this
process, reached through `AsyncEngine`. Either way the client lives on the replica's asyncio
loop. The calls it offers the ingress (`generate`, a stream of `rlt_ray.wire` events around
the engine's deltas; `model_info`, `stats`) and Ray (`check_health`, `record_routing_stats`)
are README.md's "Contracts" and "State and who writes it"; nothing survives its process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

from rlt_contracts import EngineRequest, EngineStats, ModelInfo, RltError, WireError

from rlt_ray.wire import Accepted, Finished, Rejected

logger = logging.getLogger(__name__)


def replica_tag() -> str:
    """This replica's id within its deployment (the router's key for it; "" outside Ray
    Serve). A restarted replica has a new one."""
    try:
        import ray
        from ray import serve

        if not ray.is_initialized():  # direct use, tests: asking Serve would start a cluster
            return ""
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (direct use, tests)
        return ""


def _location() -> dict:
    """Where this replica runs (in its routing stats: reports, and tests that kill it)."""
    where = {"pid": os.getpid()}
    try:
        import ray

        if ray.is_initialized():
            where["node_id"] = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not inside Ray
        pass
    return where


def engine_load(client) -> dict:
    """The load a replica reports: its requests that have not ended, counted by the replica
    itself (fresh; the engine's running / waiting gauges are as of its last step and can lag
    when idle), the engine's running and waiting requests, and its KV blocks."""
    stats = client.stats()
    return {
        "ongoing": len(client.live_request_ids()),
        "running": stats.running_requests,
        "waiting": stats.waiting_requests,
        "kv_blocks_free": stats.kv_blocks_free,
        "kv_blocks_total": stats.kv_blocks_total,
    }


def _tokenizer_or_none(model_dir: str):
    """The checkpoint's tokenizer, or None without tokenizer files (token-id prompts still
    work), as the in-thread engine has it."""
    from rlt_models import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError):
        return None


class EngineReplica:
    """One engine per replica (see the module docstring). `config`: rlt's `EngineConfig`;
    `engine_process`: the engine core in a process of its own (else on a thread here)."""

    async def __init__(self, config, *, engine_process: bool = False) -> None:
        # idle OpenMP workers must not spin a core each (as under `rlt serve`); read when
        # torch loads OpenMP, so before the engine's imports
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.tag = replica_tag()
        self.where = _location()
        self.core = None
        if engine_process:
            self.client = await self._start_core_process(config)
        else:
            from rlt.engine.llm_engine import LLMEngine
            from rlt.serving.async_engine import AsyncEngine

            engine = LLMEngine(config)
            self.client = AsyncEngine(engine, thread_name=f"rlt-engine-{self.tag or 'replica'}")
        logger.info("engine replica %s ready: %s", self.tag, self.client.model_info().name)

    async def _start_core_process(self, config):
        import asyncio

        from rlt.serving.core_client import CoreClient
        from rlt.serving.core_process_client import CoreProcess, ProcessTransport

        self.core = CoreProcess.spawn(config, start_method="spawn")  # Ray's threads run here
        try:
            endpoint = await asyncio.to_thread(self.core.wait_ready)
            tokenizer = await asyncio.to_thread(_tokenizer_or_none, endpoint.ready.model_info.path)
            transport = ProcessTransport(endpoint, "replica", owns_core=True)
            client = CoreClient(
                transport,
                model_info=endpoint.ready.model_info,
                stats=endpoint.ready.stats,
                tokenizer=lambda: tokenizer,
            )
            await transport.start(client)
        except BaseException:
            self.core.stop(timeout_s=0)
            raise
        self._transport = transport
        return client

    async def generate(self, request: EngineRequest) -> AsyncIterator[object]:
        try:
            await self.client.submit(request)
        except RltError as exc:
            yield Rejected(WireError.of(exc))
            return
        yield Accepted(self.tag, self.client.stats())
        finished = False
        try:
            async for delta in self.client.stream(request.request_id):
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # the ingress went away (client disconnect, cancel): free it
                await self.client.cancel(request.request_id)
        yield Finished(self.client.stats())

    async def model_info(self) -> ModelInfo:
        return self.client.model_info()

    async def stats(self) -> EngineStats:
        return self.client.stats()

    async def check_health(self) -> None:
        dead = self.client.dead
        if dead is not None or getattr(self.client, "stopped", False):
            raise RuntimeError(f"engine replica {self.tag} is not running: {dead}")

    async def record_routing_stats(self) -> dict:
        stats = self.client.stats()
        return {
            **engine_load(self.client),
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
            **self.where,
        }

    async def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica (scale down, redeploy, shutdown):
        # what still runs is aborted and the engine thread ends
        client = getattr(self, "client", None)
        if client is not None:
            await client.shutdown()
        if getattr(self, "core", None) is not None:
            self._transport.dispose()
            self.core.stop()
