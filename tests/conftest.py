"""Fixtures shared by the workspace tests that run the HTTP server. A module defines its own
`server` fixture (a `serving_harness.run_server(...)`, module-scoped); these give it a
checkpoint and clients. A module's own fixture of the same name takes precedence."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    """The tiny random Ouro most server tests serve (2 layers, 4 loops, a spread exit gate)."""
    return tiny_checkpoint("l2_t4", seed=3, gate_std=0.3)


@pytest.fixture(scope="module")
def http(server):
    """httpx client of the module's server."""
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's server."""
    return server.openai()
