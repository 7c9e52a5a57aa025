"""`OpenAIIngress`: the HTTP front of `rlt ray serve`, a Ray Serve ingress deployment.

It serves rlt-serve's app exactly as `rlt serve` builds it (`rlt.serving.front_end.
build_front_app`: the same routes, loop fields, exit depths, errors, API key, metrics) over a
`RayEngineClient` instead of a local engine core: tokenization and the OpenAI shapes happen
here, the engines (and detokenization) in the replicas. Its handle to the engine deployment
carries the request router (`rlt_ray.router`), which runs in this process.

Besides HTTP, a handle to this deployment offers `routing_report()`, `set_routing_policy(name)`
and `replica_stats()` (operators and tests: compare policies on one fleet).
"""

from __future__ import annotations

import asyncio
import logging

from rlt_ray.client import RayEngineClient
from rlt_ray.drain import Drainer, watch
from rlt_ray.registry import routers

logger = logging.getLogger(__name__)


class OpenAIIngress:
    """`engine`: a handle to the engine replicas; `model`: the checkpoint directory whose
    tokenizer this front uses (None: the bundled model; it must be readable on this node), or
    a Hugging Face model id at `revision` in the Hugging Face cache `download_dir` (None: main,
    huggingface_hub's cache), found there or downloaded on this node;
    `serve_options`: rlt's `ServeOptions` (API key, names, limits, loop defaults);
    `drain_key`: the command's drain signal (`rlt_ray.drain`; None: Serve's own shutdown)."""

    async def __init__(
        self,
        engine,
        model: str | None,
        serve_options,
        submit_timeout_s: float = 60.0,
        drain_key: str | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
    ) -> None:
        from rlt.engine.assembly import resolve_model_dir
        from rlt_models import load_tokenizer

        info = await engine.model_info.remote()  # waits for a first replica
        self.client = RayEngineClient(engine, info, submit_timeout_s=submit_timeout_s)
        self.tokenizer = load_tokenizer(
            resolve_model_dir(model, revision=revision, download_dir=download_dir)
        )
        self.serve_options = serve_options
        self.drainer: Drainer | None = None
        self._watching = (
            asyncio.create_task(watch(drain_key, lambda: self.drainer)) if drain_key else None
        )

    def __serve_build_asgi_app__(self):
        from rlt.serving.front_end import build_front_app

        app = build_front_app(self.client, self.tokenizer, self.serve_options, None)
        self.drainer = Drainer(app, self.client.shutdown)
        return self.drainer

    async def routing_report(self) -> dict:
        reports = [router.report() for router in routers()]
        return reports[0] if len(reports) == 1 else {"routers": reports}

    async def set_routing_policy(self, policy: str) -> str:
        found = routers()
        if not found:
            raise RuntimeError("no request router in this ingress yet")
        for router in found:
            router.policy.set_policy(policy)
        logger.info("routing policy set to %s", policy)
        return policy

    async def replica_stats(self) -> dict:
        return {key: stats for key, stats in self.client.replica_stats().items()}

    async def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica (after its drain, if any)
        if getattr(self, "_watching", None) is not None:
            self._watching.cancel()
        client = getattr(self, "client", None)
        if client is not None:
            await client.shutdown()
