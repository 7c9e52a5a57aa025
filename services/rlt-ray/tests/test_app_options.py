"""What the application builders refuse before anything reaches Ray (no cluster needed)."""

from __future__ import annotations

import os

import pytest
from rlt.engine.config import EngineConfig
from rlt_contracts import ConfigurationError
from rlt_ray import build_app, build_pd_app


@pytest.mark.parametrize("build", [build_app, build_pd_app], ids=["replicas", "pd"])
def test_a_device_index_is_refused(build):
    with pytest.raises(ConfigurationError, match="Ray assigns each replica its GPU"):
        build(EngineConfig.from_options(device="cuda:1"))


@pytest.mark.parametrize(
    ("build", "why"),
    [(build_app, "runs whole engines"), (build_pd_app, "sets each deployment's role")],
    ids=["replicas", "pd"],
)
def test_a_pd_role_is_refused(build, why):
    with pytest.raises(ConfigurationError, match=why):
        build(EngineConfig.from_options(device="cpu", pd_role="prefill"))


def test_the_cli_turns_on_serves_throughput_optimized_data_plane_unless_told(
    monkeypatch, unset_ray_defaults
):
    """`rlt ray serve` starts its Ray instance with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (the
    setting measured on the H200); a value already in the environment wins."""
    from rlt_ray import cli

    cli.set_ray_environment_defaults()
    assert os.environ[cli.THROUGHPUT_OPTIMIZED_ENV] == "1"
    assert os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0"
    monkeypatch.setenv(cli.THROUGHPUT_OPTIMIZED_ENV, "0")
    cli.set_ray_environment_defaults()
    assert os.environ[cli.THROUGHPUT_OPTIMIZED_ENV] == "0"


def test_app_builder_reads_a_config_files_args_as_the_command_line():
    """`serve run` / `serve deploy` (`import_path: rlt_ray:app_builder`): flags by name and an
    `argv` string reach the engine deployment as `rlt ray serve` would set them, and are
    checked like the command line."""
    from rlt_ray import app_builder

    app = app_builder(
        {"argv": "--device cpu --replicas 2", "enable_prefix_caching": True, "max_num_seqs": 8}
    )
    # the ingress deployment is bound to the engine deployment (Ray's bound arguments)
    engine = app._bound_deployment.init_args[0]._bound_deployment
    config = engine.init_args[0]
    assert engine.name == "RltEngine" and engine.num_replicas == 2
    assert config.runner.device == "cpu"
    assert (config.scheduler.enable_prefix_caching, config.scheduler.max_num_seqs) == (True, 8)
    with pytest.raises(ConfigurationError, match="Ray assigns each replica its GPU"):
        app_builder({"device": "cuda:1"})
