"""rlt-pd-coordinator's parts alone: error mapping, picking and credits, compatibility
messages, the command line, child command lines and startup failures (no HTTP front)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys

import msgspec
import pytest
from fake_engine import DEFAULT_COMPATIBILITY
from rlt_contracts import (
    CapacityError,
    ConfigurationError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
)
from rlt_contracts.pd import PDRole
from rlt_pd_coordinator.cli import parse
from rlt_pd_coordinator.cluster import Cluster, ClusterOptions, Instance, InstanceState
from rlt_pd_coordinator.model_files import bundled_model_dir
from rlt_pd_coordinator.server import CoordinatorOptions
from rlt_pd_coordinator.supervisor import StartupError, Supervisor, SupervisorOptions
from rlt_pd_coordinator.wire import (
    InstanceError,
    InstanceInfo,
    InstanceLoad,
    InstanceUnavailableError,
    StreamLine,
    error_from_response,
    line_decoder,
)
from rlt_serve.exit_codes import EXIT_USAGE


def body(message, *, param=None, code=None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "x", "param": param, "code": code}})


# -- wire --------------------------------------------------------------------------------------
def test_instance_errors_map_to_the_contract_errors():
    error = error_from_response(400, body("top_p: must be in (0, 1]", param="top_p"), "D")
    assert type(error) is InvalidRequestError
    assert (error.field, error.message) == ("top_p", "must be in (0, 1]")
    error = error_from_response(
        400, body("prompt: too long", param="prompt", code="context_length_exceeded"), "D"
    )
    assert isinstance(error, CapacityError) and error.message == "too long"
    assert isinstance(error_from_response(429, body("queue full"), "D"), OverloadedError)
    assert isinstance(error_from_response(503, body("dying"), "D"), InstanceUnavailableError)
    error = error_from_response(409, body("block_size: 16 here", code="pd_incompatible"), "P")
    assert isinstance(error, ConfigurationError) and "block_size: 16 here" in str(error)
    assert "--instance-api-key" in str(error_from_response(401, body("no"), "D"))
    error = error_from_response(502, b"<html>bad gateway</html>", "D")
    assert type(error) is InstanceError and "HTTP 502: <html>bad gateway</html>" in str(error)


def test_stream_lines_decode_each_kind():
    line = line_decoder.decode(b'{"error": {"message": "gone", "code": "transfer_failed"}}')
    assert line == StreamLine(error=line.error) and line.error.code == "transfer_failed"
    assert line_decoder.decode(b'{"done": {"transfer_id": "t"}}').done == {"transfer_id": "t"}
    delta = line_decoder.decode(
        b'{"delta": {"request_id": "r", "token_ids": [5], "exit_depths": [4], "finished": true,'
        b' "finish_reason": "length"}}'
    ).delta
    assert delta.exit_depths == (4,) and delta.finish_reason == "length"


# -- picking and credits -----------------------------------------------------------------------
def ready(name, role, *, credits=4, running=0, waiting=0, free=100):
    instance = Instance(name, PDRole(role), f"http://{name}", credits)
    instance.state = InstanceState.READY
    instance.info = InstanceInfo(
        role=PDRole(role),
        load=InstanceLoad(running=running, waiting=waiting, kv_blocks_free=free),
    )
    return instance


def test_pick_order_is_in_flight_then_reported_load_then_free_kv_then_round_robin():
    async def scenario():
        a = ready("a", "decode", running=2)
        b = ready("b", "decode", waiting=1)
        c = ready("c", "decode", waiting=1, free=200)
        cluster = Cluster([a, b, c])
        try:
            assert cluster.try_acquire(PDRole.DECODE) is c  # lowest load, most free KV
            assert cluster.try_acquire(PDRole.DECODE) is b  # c has one in flight now
            assert cluster.try_acquire(PDRole.DECODE) is a  # b and c have one each
            for instance in (a, b, c):
                cluster.release(instance)
            assert cluster.try_acquire(PDRole.DECODE, exclude=[c]) is b
            cluster.release(b)
            b.info = a.info
            c.info = a.info  # equal everywhere: the one picked longest ago
            assert cluster.try_acquire(PDRole.DECODE) is c
        finally:
            await cluster.close()

    asyncio.run(scenario())


def test_no_ready_instance_is_engine_dead_and_full_credits_overloaded():
    async def scenario():
        d = ready("d0", "decode", credits=1)
        down = ready("d1", "decode")
        down.state, down.reason = InstanceState.DEAD, "killed by SIGKILL; restarting in 1 s"
        cluster = Cluster([d, down], ClusterOptions(credit_wait=0.2))
        try:
            assert await cluster.acquire(PDRole.DECODE) is d
            with pytest.raises(OverloadedError, match="d0: 1/1"):
                await cluster.acquire(PDRole.DECODE)
            # a released credit wakes a waiting request
            waiter = asyncio.create_task(cluster.acquire(PDRole.DECODE))
            await asyncio.sleep(0.05)
            cluster.release(d)
            assert await waiter is d
            with pytest.raises(EngineDeadError) as dead:
                cluster.try_acquire(PDRole.PREFILL)
            assert "no prefill instance is available (none configured)" in str(dead.value)
            d.state = InstanceState.UNREACHABLE
            with pytest.raises(EngineDeadError, match="d1: dead .killed by SIGKILL"):
                cluster.try_acquire(PDRole.DECODE)
            assert (
                cluster.unavailable_reason() == "no prefill instance is available (none configured)"
            )
        finally:
            await cluster.close()

    asyncio.run(scenario())


def test_compatibility_messages_name_every_field_with_both_values():
    async def scenario():
        p, d, r = ready("p0", "prefill"), ready("d0", "decode"), ready("r0", "none")
        other = msgspec.structs.replace(DEFAULT_COMPATIBILITY, block_size=32, dtype="float16")
        p.info = msgspec.structs.replace(p.info, compatibility=DEFAULT_COMPATIBILITY)
        d.info = msgspec.structs.replace(d.info, compatibility=other)
        cluster = Cluster([p, d])
        [line] = cluster.mismatches(p, [d])
        assert "prefill instance p0 (http://p0) vs decode instance d0 (http://d0)" in line
        assert "dtype 'bfloat16' on p0, 'float16' on d0" in line
        assert "block_size 16 on p0, 32 on d0" in line
        await cluster.close()
        # replicas only need the same model; their KV layout may differ
        r.info = msgspec.structs.replace(r.info, compatibility=other)
        router = Cluster([p, r], ClusterOptions(mode="router"))
        assert router.mismatches(p, [r]) == []
        await router.close()

    asyncio.run(scenario())


# -- command line ------------------------------------------------------------------------------
def test_command_line_model_engine_flags_devices_and_keys(tmp_path):
    options = parse(
        [
            "pd",
            "serve",
            str(tmp_path),
            "--num-prefill",
            "1",
            "--dtype",
            "float32",
            "--num-decode",
            "2",
            "--device",
            "cuda:0,cuda:1",
            "--device",
            "cuda:2",
            "--enable-prefix-caching",
            "--decode-credits",
            "8",
            "--max-num-seqs",
            "4",
        ]
    )
    assert options.model == str(tmp_path) and options.mode == "pd"
    assert options.engine_args == (
        "--dtype",
        "float32",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "4",
    )
    assert options.devices == ("cuda:0", "cuda:1", "cuda:2")
    assert options.coordination.decode_credits == 8 and options.instance_api_key  # a random key
    names = [(i.name, i.role, i.local) for i in options.instances()]
    assert names == [
        ("prefill-0", "prefill", True),
        ("decode-0", "decode", True),
        ("decode-1", "decode", True),
    ]

    options = parse(
        ["serve", "--prefill-url", "http://p:1/", "--decode-url", "http://d:2", "--api-key", "k"]
    )
    assert options.model is None and options.instance_api_key == "k"
    assert [i.url for i in options.instances()] == ["http://p:1", "http://d:2"]
    router = parse(["serve", "--url", "http://a:1", "--replica-url", "http://b:2"])
    assert router.mode == "router" and router.replica_urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--num-prefill", "1"], "needs at least one decode instance"),
        (["serve", "--replicas", "2", "--num-decode", "1"], "not both"),
        (["serve", "--decode-url", "u", "--prefill-url", "v", "--dtype", "float32"], "--dtype"),
        (["serve", "--replicas", "1", "--replica-credits", "0"], "replica_credits: must be >= 1"),
        (["serve", "m", "--model", "n", "--replicas", "1"], "give the model directory once"),
    ],
)
def test_command_line_refusals(argv, message):
    from rlt_pd_coordinator.server import Coordinator

    with pytest.raises(ConfigurationError, match=message):
        Coordinator(parse(argv))


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["serve", "--bogus"], "--bogus"),  # before "PD needs at least one prefill instance"
        (["serve", "--replicas", "1", "--bogus", "x"], "--bogus x"),
        (["serve", "m", "--num-prefill", "1", "--num-decode", "1", "m2"], "m2"),
    ],
)
def test_an_unknown_argument_is_refused_with_the_usage_of_rlt_pd_serve(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: rlt pd serve [MODEL] ")
    assert err.endswith(f"rlt pd serve: error: unrecognized arguments: {unknown}\n")


def test_another_engine_command_gets_the_flags_rlt_pd_serve_does_not_know():
    argv = ["serve", "--replicas", "1", "--engine-command", "my-engine --x", "--dtype", "float32"]
    options = parse([*argv, "--my-flag", "3"])
    assert options.command == ("my-engine", "--x")
    assert options.engine_args == ("--dtype", "float32", "--my-flag", "3")


@pytest.mark.skipif(
    importlib.util.find_spec("rlt") is None,
    reason="the rlt engine (which bundles the model) is not installed alongside the coordinator",
)
def test_bundled_model_is_found_without_importing_rlt():
    found = bundled_model_dir()
    assert found is not None and (found / "tokenizer.json").exists()


# -- children ----------------------------------------------------------------------------------
def test_child_command_lines_and_device_round_robin():
    options = CoordinatorOptions(num_prefill=1, num_decode=2, engine_args=("--dtype", "float32"))
    cluster = Cluster(options.instances())
    supervisor = Supervisor(
        cluster,
        SupervisorOptions(
            model="/m",
            command=("rlt", "serve"),
            engine_args=options.engine_args,
            devices=("cuda:0", "cuda:1"),
        ),
    )
    argvs = [supervisor.argv(c) for c in supervisor.children]
    assert argvs[0][:4] == ["rlt", "serve", "/m", "--pd-role"] and argvs[0][4] == "prefill"
    assert [a[a.index("--device") + 1] for a in argvs] == ["cuda:0", "cuda:1", "cuda:0"]
    assert all(a[a.index("--host") + 1] == "127.0.0.1" and "--dtype" in a for a in argvs)
    assert len({c.port for c in supervisor.children}) == 3
    asyncio.run(cluster.close())


def test_a_child_that_exits_at_startup_fails_the_start_with_its_output(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\nprint('rlt serve: error: --bogus is not an option')\nsys.exit(2)\n"
    )

    async def scenario():
        cluster = Cluster(CoordinatorOptions(num_prefill=1, num_decode=1).instances())
        supervisor = Supervisor(
            cluster,
            SupervisorOptions(
                model="/m", command=(sys.executable, str(script)), output=open(tmp_path / "o", "w")
            ),
        )
        try:
            with pytest.raises(StartupError) as failed:
                await supervisor.start()
        finally:
            await supervisor.stop()
            await cluster.close()
        return str(failed.value)

    message = asyncio.run(scenario())
    assert "prefill-0 exited with status 2 before it was ready" in message
    assert "decode-0 exited with status 2" in message
    assert "--bogus is not an option" in message


# -- membership (rlt-ray's PD ingress adds and removes instances) -------------------------------
def test_added_instances_are_admitted_and_connected_removed_ones_never_picked():
    from fake_engine import FakeEngine, serve_fake

    incompatible = msgspec.structs.replace(DEFAULT_COMPATIBILITY, block_size=32)
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    odd = FakeEngine("decode", compatibility=incompatible)

    async def scenario(urls: dict[str, str]) -> None:
        cluster = Cluster([], ClusterOptions(poll_interval=0.05, credit_wait=0))
        cluster.start_polling()
        try:
            prefill = Instance("prefill-a", PDRole.PREFILL, urls["p"], 4)
            decode = Instance("decode-b", PDRole.DECODE, urls["d"], 4)
            cluster.add(prefill)
            cluster.add(decode)
            for _ in range(100):
                if cluster.unavailable_reason() is None:
                    break
                await asyncio.sleep(0.05)
            assert cluster.unavailable_reason() is None
            assert prefill.admitted_agent == p.agent and decode.admitted_agent == d.agent
            assert d.agent in p.peers and p.agent in d.peers  # connected both ways

            # an incompatible newcomer is refused, and stays refused across polls (before
            # the admitted agent was recorded, a poll that saw the same agent routed to it)
            other = Instance("decode-c", PDRole.DECODE, urls["odd"], 4)
            cluster.add(other)
            await asyncio.sleep(0.5)
            assert other.state is not InstanceState.READY and other.admitted_agent is None

            cluster.remove(decode, "replaced")
            assert decode not in cluster.instances and decode.state is InstanceState.STOPPED
            with pytest.raises(EngineDeadError):
                cluster.try_acquire(PDRole.DECODE)  # only the refused one is left
        finally:
            await cluster.close()

    with contextlib.ExitStack() as stack:
        engines = {"p": p, "d": d, "odd": odd}
        servers = {k: stack.enter_context(serve_fake(e)) for k, e in engines.items()}
        asyncio.run(scenario({k: s.url for k, s in servers.items()}))
