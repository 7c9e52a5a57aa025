"""`rlt serve` stopped as users and their launchers stop it: started as `uv run rlt serve ...`
(the README's launcher) in a process group of its own, then SIGINT or SIGTERM to the whole
group (a terminal's Ctrl-C, systemd, `kill -- -PGID`: uv forwards its own copy as well) or to
uv alone, at start-up or while serving (docs/serving.md, Shutdown; `rlt_serve.shutdown`).

Every stop: exit code 0 within the documented bound, no traceback, no process of the command
left (the engine core, every front end), and each request in flight answered: drained if it
finishes within --shutdown-timeout, else 200 with its partial text and finish_reason "abort"
(a stream's last chunk, then `[DONE]`). A genuine second signal, sent after the first was
handled, ends the drain at once (exit 130), just as cleanly. Without a model it exits 2."""

from __future__ import annotations

import random
import signal
import time

import httpx
import pytest
from launcher_harness import UV, InFlight, Launch
from launcher_harness import check_stopped_cleanly as check_stopped
from rlt.cli import main
from rlt_serve.shutdown import DUPLICATE_WINDOW_S, STOP_BOUND_MARGIN_S
from serving_harness import free_port

GRACE_S = 1.0  # --shutdown-timeout: requests that outlive it are aborted
EXIT_BOUND_S = GRACE_S + STOP_BOUND_MARGIN_S  # documented: from the first signal to the exit
LONG = {"prompt": "It is a truth", "max_tokens": 1000, "ignore_eos": True}  # outlives the drain
SHORT = {"prompt": "My dear Emma,", "max_tokens": 2}  # ends within it

needs_uv = pytest.mark.skipif(UV is None, reason="these tests start the server with `uv run`")


def serve(port: int, *flags: str, shutdown_timeout: float = GRACE_S) -> Launch:
    """The bundled model's server, as the README starts it (on the CPU)."""
    return Launch(
        "rlt",
        "serve",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--shutdown-timeout",
        str(shutdown_timeout),
        *flags,
        port=port,
    )


def check_stopped_cleanly(launch: Launch, signalled_at: float, expected_code: int = 0) -> str:
    return check_stopped(launch, signalled_at, EXIT_BOUND_S, expected_code)


def in_flight_requests(launch: Launch, short: bool = True) -> InFlight:
    return InFlight(launch.base_url, long=LONG, short=SHORT if short else None)


# Points of a start, each reached by waiting for a mark, then a random delay (seconds).
STARTING = "the stop-signal policy is installed (imports, argument checks, the core forked)"
CORE = "the engine core builds the model while the supervisor loads the tokenizer"
FRONT_ENDS = "the front ends start"
IDLE = "serving, nothing in flight"
BUSY = "serving, requests in flight"
POINTS = [STARTING, CORE, FRONT_ENDS, STARTING, CORE, FRONT_ENDS, IDLE, BUSY, BUSY, BUSY]


@needs_uv
@pytest.mark.slow
def test_ten_process_group_sigints_under_uv_run_at_random_points_each_stop_cleanly():
    """`uv run rlt serve --api-server-count 2`, stopped ten times in a row by a SIGINT to its
    process group, at random points of start-up and serving (uv forwards a second copy of each
    SIGINT 200 ms later: it must not cut the drain short)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    points = rng.sample(POINTS, len(POINTS))
    for run, point in enumerate(points):
        port = free_port()
        launch = serve(port, "--api-server-count", "2")
        in_flight = None
        try:
            launch.wait_policy_installed()
            if point == CORE:
                assert launch.output.wait_for("[core]: start-up:")
            elif point == FRONT_ENDS:
                assert launch.output.wait_for("API servers starting")
            elif point in (IDLE, BUSY):
                launch.wait_healthy()
            if point == BUSY:
                in_flight = in_flight_requests(launch)
                in_flight.start()
            time.sleep(rng.uniform(0, 0.3 if point == FRONT_ENDS else 0.8))
            sent = launch.signal_group(signal.SIGINT)
            try:
                check_stopped_cleanly(launch, sent)
                if in_flight is not None:
                    in_flight.check_answered()
            except AssertionError as failure:
                raise AssertionError(f"run {run} (seed {seed}), {point}: {failure}") from None
        finally:
            launch.kill()


@needs_uv
@pytest.mark.slow
def test_sigterm_to_the_process_group_drains_and_exits_0():
    port = free_port()
    launch = serve(port)
    try:
        launch.wait_healthy()
        in_flight = in_flight_requests(launch)
        in_flight.start()
        sent = launch.signal_group(signal.SIGTERM)
        output = check_stopped_cleanly(launch, sent)
        in_flight.check_answered()
        assert "Application shutdown complete" in output, output
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{launch.base_url}/health", trust_env=False, timeout=2)
    finally:
        launch.kill()


@needs_uv
@pytest.mark.slow
def test_sigint_to_the_launcher_alone_drains_and_exits_0():
    """A SIGINT to uv only (no terminal): uv forwards it, once; the two front ends drain."""
    port = free_port()
    launch = serve(port, "--api-server-count", "2")
    try:
        launch.wait_healthy()
        in_flight = in_flight_requests(launch, short=False)
        in_flight.start()
        sent = time.monotonic()
        launch.process.send_signal(signal.SIGINT)
        output = check_stopped_cleanly(launch, sent)
        in_flight.check_answered()
        assert "a duplicate" not in output, output  # one signal, not two
    finally:
        launch.kill()


@needs_uv
@pytest.mark.slow
def test_a_second_sigint_after_the_first_was_handled_ends_the_drain_at_once():
    """The drain would wait 600 s for two long requests; a second Ctrl-C to the group, well
    after the first was handled, aborts them at once: each still answers cleanly (200 with
    its partial text, the stream's last chunk and `[DONE]`), no traceback, exit 130."""
    port = free_port()
    launch = serve(port, shutdown_timeout=600)
    try:
        launch.wait_healthy()
        in_flight = in_flight_requests(launch, short=False)
        in_flight.start()
        launch.signal_group(signal.SIGINT)  # (uv's copy follows 200 ms later: not counted)
        assert launch.output.wait_for("requests in flight get up to 600 s")
        time.sleep(DUPLICATE_WINDOW_S + 0.5)  # a person's second Ctrl-C comes later
        assert launch.process.poll() is None, "the first SIGINT did not drain"
        sent = launch.signal_group(signal.SIGINT)
        output = check_stopped_cleanly(launch, sent, expected_code=128 + signal.SIGINT)
        assert time.monotonic() - sent < 30, "the second SIGINT did not end the drain"
        in_flight.check_answered()
        assert "SIGINT during the drain: ending the requests still running" in output, output
    finally:
        launch.kill()


def test_serve_without_a_model_explains_and_exits_2(monkeypatch, tmp_path, capsys):
    import rlt.engine.assembly as assembly

    monkeypatch.setattr(assembly, "DEFAULT_MODEL_DIR", tmp_path / "no-default-model")
    assert main(["serve"]) == 2
    error = capsys.readouterr().err
    assert "bundled default model is missing" in error and "rlt serve MODEL_DIR" in error
