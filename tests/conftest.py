"""Fixtures shared by the workspace tests that run the HTTP server. A module defines its own
`server` fixture (a `serving_harness.run_server(...)`, module-scoped); these give it a
checkpoint and clients (defined in services/rlt-engine/tests/serving_harness.py, shared with
rlt-engine's own server tests). A module's own fixture of the same name takes precedence."""

from __future__ import annotations

from serving_harness import checkpoint, client, http  # noqa: F401  (fixtures)
