"""The engine-core process: a busy loop of schedule -> execute -> update that talks to its front
ends only in msgspec messages over ZeroMQ (M2).

    front end i (DEALER, identity "fe<i>")  --CoreInput-->   ROUTER (this process)
                                           <--CoreOutputs--  one per round per front end

One ROUTER socket on an ipc:// address carries both directions; each message is one msgpack
frame. The loop blocks in `poll` while no request is unfinished and otherwise drains whatever
arrived before every step, so a message waits at most one step.

Liveness, with no polling of process ids:
- `parent_alive`: the read end of a pipe whose only write end the parent holds. It becomes
  readable (EOF) when the parent dies, however it died: the core then aborts everything and
  exits, so no core outlives its server.
- `core_alive`: the write end of a pipe whose read ends the front ends watch; the kernel closes
  it when this process ends, however it ended, and every front end learns at once.

SIGINT and SIGTERM are ignored here: a terminal's Ctrl-C reaches the whole process group, and
the front end (or the supervisor) decides when the core stops, by `CoreShutdown` after its
drain (or by closing `parent_alive`). The parent starts this process with both signals
blocked (`rlt_serve.shutdown`, `StopSignals.spawning`): they are unblocked once ignored.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys

import msgspec
from rlt_contracts import CoreInput, CoreReady, RltError, WireError
from rlt_serve.shutdown import unblock_stop_signals

from rlt.engine.config import EngineConfig
from rlt.engine.startup import configure_logging

logger = logging.getLogger(__name__)

COMPILE_POLL_MS = 5  # an idle core with grammars compiling looks again this often
# A file path: the core records every step (EngineCore.step_log) and writes them there as JSON
# lines when it stops (diagnostics: where served time goes, benchmarks/step_timeline.py).
STEP_LOG_VARIABLE = "RLT_STEP_LOG"


def run_core_process(
    config: EngineConfig,
    address: str,
    ready,  # multiprocessing Connection: ("ready", CoreReady) or ("error", WireError), once
    parent_alive,  # multiprocessing Connection (read end)
    core_alive,  # multiprocessing Connection (write end), held until exit
    log_level: str = "info",
    parent_only: tuple = (),  # the parent's pipe ends: a forked child closes its copies
) -> None:
    """Entry point of the core process (forked, or spawned)."""
    for end in parent_only:
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    unblock_stop_signals()  # held while the parent started this process: now ignored
    configure_logging(log_level, "core")
    import zmq

    from rlt.engine.assembly import build_engine, model_info
    from rlt.engine.core_loop import CoreLoop

    try:
        parts = build_engine(config)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, then fatal
        if not isinstance(error, RltError):
            logger.exception("the engine could not be built")
        _tell_parent(ready, ("error", msgspec.msgpack.encode(WireError.of(error))))
        sys.exit(1)
    pd = parts.pd
    core_loop = CoreLoop(
        parts.core,
        constraint_compiler=parts.constraint_compiler,
        pd_transport=pd.transport if pd is not None else None,
        stats_interval_s=config.stats_interval_s if config.log_stats else None,
    )
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(address)
    ready_message = CoreReady(
        model_info=model_info(parts),
        stats=parts.core.stats(),
        pd=pd.static_info() if pd is not None else None,
    )
    step_log_path = os.environ.get(STEP_LOG_VARIABLE)
    if step_log_path:
        parts.core.step_log = []
    told = _tell_parent(ready, ("ready", msgspec.msgpack.encode(ready_message)))
    ready.close()
    try:
        if told:  # (else its parent was stopped while it started: nothing to serve)
            _serve(core_loop, socket, parent_alive)
            _log_totals(parts.core)
            if step_log_path:
                _write_step_log(parts.core.step_log, step_log_path)
    finally:
        socket.close(linger=1000)  # the last outputs (final deltas) still go out
        context.term()
        parts.core.close()
        core_alive.close()
    os._exit(0)  # skip interpreter teardown (CUDA contexts, NIXL agents): the work is done


def _tell_parent(ready, message) -> bool:
    """Send the start-up's outcome; False when the process that started this core is gone
    (it was stopped or killed while the core started: no one is left to tell)."""
    try:
        ready.send(message)
    except OSError:  # BrokenPipeError
        logger.info("the process that started this core is gone: exiting")
        return False
    return True


def _serve(core_loop, socket, parent_alive) -> None:
    import zmq

    decoder = msgspec.msgpack.Decoder(CoreInput)
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(parent_alive.fileno(), zmq.POLLIN)
    while not core_loop.stopped:
        if core_loop.has_work:
            timeout = 0
        else:
            timeout = COMPILE_POLL_MS if core_loop.compiling else None
            wake_s = core_loop.wake_in_s()  # the live statistics line of an ended burst
            if wake_s is not None:
                wake_ms = math.ceil(wake_s * 1000)
                timeout = wake_ms if timeout is None else min(timeout, wake_ms)
        events = dict(poller.poll(timeout))
        if parent_alive.fileno() in events:
            logger.info("the process that started this core stopped or died: shutting down")
            core_loop.shutdown()
            return
        while True:
            try:
                client, payload = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            core_loop.handle(client.decode(), decoder.decode(payload))
        if core_loop.has_replies:
            _send(socket, encoder, core_loop.take_outputs())
        if not core_loop.stopped:
            core_loop.step()
        _send(socket, encoder, core_loop.take_outputs())


def _log_totals(core) -> None:
    """One line at exit: how the core spent its steps (compare with an offline run's)."""
    timings, stats = core.timings, core.stats()
    logger.info(
        "core totals: %d steps (%d decode ticks), %d prompt / %d generated tokens; host %.2f s,"
        " read-back wait %.2f s",
        timings.steps,
        timings.decode_ticks,
        stats.prompt_tokens,
        stats.generation_tokens,
        timings.host_s,
        timings.readback_wait_s,
    )


def _write_step_log(records, path: str) -> None:
    import dataclasses
    import json

    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(dataclasses.asdict(record)) + "\n")
    logger.info("step log: %d steps written to %s", len(records), path)


def _send(socket, encoder, outputs: dict) -> None:
    for client, message in outputs.items():
        socket.send_multipart([client.encode(), encoder.encode(message)], copy=False)
