"""The `rlt ray` command lines, checked without starting Ray: every command line builds its
options (a flag read but never declared fails here, as `rlt ray pd serve` once did on every
start), refused flags are refused with advice and kept out of --help, the cluster is chosen
as documented, and an ingress drains as documented (the stop signals are rlt's one policy,
tested with rlt-serve: `rlt_serve.shutdown`)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import httpx
import pytest
from rlt_contracts import ConfigurationError
from rlt_ray import cli
from rlt_ray.drain import Drainer
from rlt_ray.runner import Placement, cluster_address


@pytest.fixture(autouse=True)
def _ray_environment_restored(monkeypatch):
    """`cli.main` sets Ray's environment defaults for the cluster it would start: undone after
    each test (this process may run the Ray cluster tests next)."""
    for name in (cli.THROUGHPUT_OPTIMIZED_ENV, "RAY_ENABLE_UV_RUN_RUNTIME_ENV"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


SERVE_FLAGS = [
    "serve",
    "--replicas",
    "2",
    "--router",
    "least_loaded",
    "--engine-process",
    "--replica-resource",
    "rlt_gpu=1",
    "--address",
    "auto",
    "--app-name",
    "rlt-a",
    "--route-prefix",
    "/a",
    "--shutdown-timeout",
    "3",
    "--max-model-loops",
    "4",
]
PD_FLAGS = [
    "pd",
    "serve",
    "--num-prefill",
    "1",
    "--num-decode",
    "2",
    "--prefill-resource",
    "p=1",
    "--decode-resource",
    "d=1",
    "--prefill-credits",
    "4",
    "--instance-api-key",
    "k",
    "--app-name",
    "rlt-pd",
    "--max-model-loops",
    "4",
]


@pytest.mark.parametrize(
    "argv",
    [["serve"], SERVE_FLAGS, ["pd", "serve", "--num-prefill", "1", "--num-decode", "1"], PD_FLAGS],
    ids=["serve", "serve-flags", "pd", "pd-flags"],
)
def test_every_command_line_builds_its_options(argv):
    args = cli.build_parser().parse_args(argv)
    config, serve_options, options, address = cli.options_from_args(args)
    placement = cli.placement_from_args(args, 1)
    assert address == args.address == placement.address
    assert serve_options.shutdown_timeout == options.graceful_shutdown_timeout_s
    if argv is SERVE_FLAGS:
        assert (options.replicas, options.router, options.engine_process) == (
            2,
            "least_loaded",
            True,
        )
        assert options.resources == {"rlt_gpu": 1.0}
        assert placement == Placement("auto", "rlt-a", "/a", 1)
    if argv is PD_FLAGS:
        coordination = options.coordination
        assert (options.num_prefill, options.num_decode, coordination.prefill_credits) == (1, 2, 4)
        assert options.decode_resources == {"d": 1.0}
        assert placement.app_name == "rlt-pd" and placement.route_prefix == "/"
    assert config.pd.role == "none"
    assert config.model.max_model_loops == (4 if argv in (SERVE_FLAGS, PD_FLAGS) else None)


@pytest.mark.parametrize("command", [["serve"], ["pd", "serve"]], ids=["serve", "pd"])
def test_the_front_end_count_is_not_offered_and_refused_with_advice(
    command, capsys, unset_ray_defaults
):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    assert "--api-server-count" not in capsys.readouterr().out
    assert cli.main([*command, "--api-server-count", "2"]) == cli.EXIT_USAGE
    assert "--ingress-replicas" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "field"),
    [(["--route-prefix", "v1"], "route_prefix"), (["--app-name", " "], "app_name")],
)
def test_a_bad_app_name_or_route_is_refused(flags, field):
    args = cli.build_parser().parse_args(["serve", *flags])
    with pytest.raises(ConfigurationError) as raised:
        cli.options_from_args(args)
    assert raised.value.options == (field,)


def test_a_private_cluster_is_not_started_for_a_bad_model_or_a_taken_port(
    monkeypatch, tmp_path, capsys, unset_ray_defaults
):
    """Checked before Ray starts (exit 2, naming what is wrong), as `rlt serve` does."""
    ray_serve_was_imported = "ray.serve" in sys.modules
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["serve", str(tmp_path)]) == cli.EXIT_USAGE
    assert "lacks config.json" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["pd", "serve", "--port", str(port)]) == cli.EXIT_USAGE
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert "ray.serve" not in sys.modules or ray_serve_was_imported  # refused before Ray


def test_the_cluster_is_the_flag_then_ray_address_then_a_private_one(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address("auto") == ("auto", "--address")
    assert cluster_address(None) == ("10.0.0.1:6379", "RAY_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert cluster_address(None) == (None, "private")
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster_address(None) == (None, "private")


def test_a_draining_ingress_refuses_new_requests_and_aborts_what_outlasts_the_grace():
    """The Drainer around a real Starlette app: a request that ends within the grace ends
    normally, one that does not is aborted (the abort callback ends it), a new one gets 503."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def scenario():
        release_slow = asyncio.Event()
        aborted = []

        async def slow(request):
            await release_slow.wait()
            return PlainTextResponse("aborted" if aborted else "finished")

        async def quick(request):
            await asyncio.sleep(0.05)
            return PlainTextResponse("quick")

        async def abort():
            aborted.append(True)
            release_slow.set()

        app = Starlette(routes=[Route("/slow", slow), Route("/quick", quick)])
        drainer = Drainer(app, abort)
        transport = httpx.ASGITransport(app=drainer)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            slow_call = asyncio.create_task(client.get("/slow"))
            quick_call = asyncio.create_task(client.get("/quick"))
            while drainer.in_flight < 2:
                await asyncio.sleep(0.01)
            drainer.request(0.5)
            refused = await client.get("/quick")
            quick_answer = await quick_call
            assert not aborted  # the grace is still running
            slow_answer = await slow_call
            await asyncio.wait_for(drainer.done.wait(), 5)
        return refused, quick_answer, slow_answer, aborted

    refused, quick_answer, slow_answer, aborted = asyncio.run(scenario())
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert quick_answer.text == "quick"
    assert slow_answer.text == "aborted" and aborted == [True]
