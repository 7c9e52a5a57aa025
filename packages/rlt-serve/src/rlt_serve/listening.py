"""The servers' listening address: `--port` checked when the command line is parsed, and the
socket bound (or the port probed) before a model loads, so that a taken port fails in a second
with a clear message instead of after the whole engine started. `rlt serve`, `rlt pd serve`
and their front ends share these, and exit with `EXIT_USAGE` (2) on either failure."""

from __future__ import annotations

import argparse
import socket

from rlt_contracts import ConfigurationError

MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse `type=` for --port: an integer in 0..65535 (0: the OS picks a free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_PORT}, got {port}")
    return port


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port as uvicorn binds one (SO_REUSEADDR, IPv6 when the host has a
    colon), not yet listening: hand it to uvicorn (`sockets=[...]`). A taken port or an address
    this machine does not have is a `ConfigurationError` naming host and port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ConfigurationError(
            ("host", "port"), f"cannot listen on {host}:{port}: {reason}"
        ) from None
    return sock


def check_can_listen(host: str, port: int) -> None:
    """Probe host:port (bind, then release it) before a slow start-up that binds it later."""
    listening_socket(host, port).close()
