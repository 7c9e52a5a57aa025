"""The servers' listening address: --port checked at parsing, a taken port a clear
`ConfigurationError` naming host and port, a probe that leaves the port free."""

from __future__ import annotations

import argparse
import socket

import pytest
from rlt_contracts import ConfigurationError
from rlt_serve.listening import check_can_listen, listening_socket, port_number


@pytest.mark.parametrize("text, port", [("0", 0), ("8000", 8000), ("65535", 65535)])
def test_ports_0_to_65535_are_accepted(text, port):
    assert port_number(text) == port


@pytest.mark.parametrize(
    "text, message",
    [("65536", "must be in 0..65535, got 65536"), ("-1", "got -1"), ("http", "not a port")],
)
def test_other_ports_are_refused_at_parsing(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        port_number(text)
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=port_number)
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--port", text])
    assert refused.value.code == 2


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_taken_port_names_host_and_port(taken_port):
    with pytest.raises(ConfigurationError) as error:
        listening_socket("127.0.0.1", taken_port)
    assert error.value.options == ("host", "port")
    assert f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in str(error.value)
    with pytest.raises(ConfigurationError, match="cannot listen"):
        check_can_listen("127.0.0.1", taken_port)


def test_an_address_this_machine_lacks_is_refused_too():
    with pytest.raises(ConfigurationError, match="cannot listen on 192.0.2.1:"):
        check_can_listen("192.0.2.1", 0)  # TEST-NET-1: never a local address


def test_the_probe_leaves_the_port_free_and_a_bound_socket_serves():
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    check_can_listen("127.0.0.1", port)
    with listening_socket("127.0.0.1", port) as again:  # the probe released it
        again.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
