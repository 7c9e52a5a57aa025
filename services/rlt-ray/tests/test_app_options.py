"""What the application builders refuse before anything reaches Ray (no cluster needed)."""

from __future__ import annotations

import pytest
from rlt.engine.config import EngineConfig
from rlt_contracts import ConfigurationError
from rlt_ray import build_app, build_pd_app


@pytest.mark.parametrize("build", [build_app, build_pd_app], ids=["replicas", "pd"])
def test_a_device_index_is_refused(build):
    with pytest.raises(ConfigurationError, match="Ray assigns each replica its GPU"):
        build(EngineConfig(device="cuda:1"))


@pytest.mark.parametrize(
    ("build", "why"),
    [(build_app, "runs whole engines"), (build_pd_app, "sets each deployment's role")],
    ids=["replicas", "pd"],
)
def test_a_pd_role_is_refused(build, why):
    with pytest.raises(ConfigurationError, match=why):
        build(EngineConfig(device="cpu", pd_role="prefill"))
