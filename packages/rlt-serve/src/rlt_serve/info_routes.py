"""What the server serves: GET /v1/models, GET /v1/models/{model}, GET /version."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from rlt_serve.context import ServerContext
from rlt_serve.params import check_model
from rlt_serve.response_schemas import ModelCard, ModelList


class Version(BaseModel):
    version: str = Field(description="The server's version (its package metadata).")


def package_version(distribution: str = "rlt-serve") -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def add_info_routes(
    app: FastAPI, ctx: ServerContext, *, version: str, errors: dict[int | str, dict[str, Any]]
) -> None:
    def card() -> ModelCard:
        info = ctx.model_info
        return ModelCard(
            id=ctx.served_model_name,
            created=ctx.created,
            max_model_len=info.max_model_len,
            num_loops=info.num_loops,
            default_loops=info.default_loops or None,
            weight_dtype=info.weight_dtype or None,
            kv_cache_dtype=info.kv_cache_dtype or None,
            kv_capacity_tokens=info.kv_capacity_tokens or None,
        )

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=errors,
        tags=["openai"],
        summary="List the served model",
    )
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get(
        "/v1/models/{model:path}",
        response_model=ModelCard,
        responses=errors,
        tags=["openai"],
        summary="Describe the served model (404 for any other name)",
    )
    async def retrieve_model(model: str) -> ModelCard:
        check_model(model, ctx.served_model_name)
        return card()

    @app.get("/version", response_model=Version, tags=["ops"], summary="The server's version")
    async def server_version() -> Version:
        return Version(version=version)
