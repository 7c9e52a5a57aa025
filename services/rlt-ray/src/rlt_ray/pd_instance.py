"""`PDInstanceReplica`: one PD engine instance in one Ray Serve replica of `rlt ray pd serve`
(the prefill and decode deployments of `rlt_ray.pd`): what `rlt serve MODEL --pd-role ROLE`
runs, in the replica's process, reachable over HTTP at the URL it reports to the ingress."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import uvicorn

from rlt_ray.replicas import _location, engine_load, replica_tag

logger = logging.getLogger(__name__)


def _node_host() -> str:
    """The address peers reach this node at (Ray's own view of it)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (direct use): loopback
        return "127.0.0.1"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class PDInstanceReplica:
    """One PD engine instance in one Ray Serve replica: what `rlt serve MODEL --pd-role ROLE`
    runs, in the replica's process. The engine core runs on a thread (`build_server`), its
    HTTP app (OpenAI routes plus /internal/pd/*, behind `api_key`) is served by uvicorn on a
    free port of this node, on the replica's event loop.

    Ray hooks: `check_health` raises once the engine died or the HTTP server stopped (Ray
    then replaces the replica); `record_routing_stats` reports where to reach it and its load
    (the ingress's membership). `describe()` returns the same (the ingress's first call).
    """

    async def __init__(self, config, role: str, api_key: str) -> None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
        from rlt.engine.llm_engine import LLMEngine
        from rlt.serving.front_end import uvicorn_config
        from rlt.serving.server import build_server
        from rlt_serve.front_options import ServeOptions

        if config.pd.role != role:
            config = config.with_options(pd_role=role)
        self.role = role
        self.tag = replica_tag()
        self.where = _location()
        host = _node_host()
        self.engine = LLMEngine(config)
        options = ServeOptions(host=host, port=0, api_key=api_key, log_level="warning")
        app, self.client = build_server(self.engine, options)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        self.url = _url(host, sock.getsockname()[1])
        self.server = _InstanceServer(uvicorn_config(app, options))
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
                raise RuntimeError(f"the HTTP server of {role} replica {self.tag} stopped")
            await asyncio.sleep(0.02)
        logger.info("%s replica %s serves at %s", role, self.tag, self.url)

    def _report(self) -> dict:
        pd = self.engine.parts.pd if self.engine.parts is not None else None
        return {
            "url": self.url,
            "role": self.role,
            "agent": pd.agent if pd is not None else "",
            # transfers pending in this engine's handoff port (read from the engine thread's
            # connectors without a lock: a snapshot, exact once the engine is idle)
            "pd_busy": bool(pd.port.busy) if pd is not None else False,
            **engine_load(self.client),
            **self.where,
        }

    async def describe(self) -> dict:
        return self._report()

    async def record_routing_stats(self) -> dict:
        return self._report()

    async def check_health(self) -> None:
        dead = self.client.dead
        if dead is not None or self.client.stopped:
            raise RuntimeError(f"{self.role} replica {self.tag}: the engine is not running: {dead}")
        if self._serving.done():
            raise RuntimeError(f"{self.role} replica {self.tag}: its HTTP server stopped")

    async def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica: stop listening, abort what runs
        server = getattr(self, "server", None)
        if server is not None:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serving, 10)
        client = getattr(self, "client", None)
        if client is not None:
            await client.shutdown()


class _InstanceServer(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process belongs to Ray."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
