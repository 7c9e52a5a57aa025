"""`rlt_pd.nixl_agent.make_agent` over the real `nixl` package: an idle transport's progress
thread does not occupy a CPU core (NIXL's own Python API makes it poll without pause), the
binding's config class is put back after each construction, and bad delays are refused."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from nixl import _api  # noqa: E402
from nixl_peer import compatibility, tensors, transport  # noqa: E402
from rlt_pd.nixl_agent import make_agent  # noqa: E402

# A thread that polls without pause takes ~1 CPU-second per second; the waiting one took 0.03
# on the 2-core development machine. The bound leaves room for a loaded CI machine's noise and
# is far below what a spinning thread takes even when it shares a core with another process.
IDLE_CPU_BOUND = 0.25


def idle_cpu_per_s(seconds: float = 1.0) -> float:
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def test_an_idle_transport_leaves_the_cpu_alone():
    idle = transport("idle", tensors(seed=None), compatibility())
    try:
        assert idle_cpu_per_s() < IDLE_CPU_BOUND
    finally:
        idle.close()


def test_the_binding_config_class_is_restored_and_agents_work():
    native = _api.nixlBind.nixlAgentConfig
    agent = make_agent("restored", 250)
    assert _api.nixlBind.nixlAgentConfig is native
    agent.create_backend("UCX", dict(agent.get_plugin_params("UCX")))
    assert "UCX" in agent.get_plugin_list()


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match="progress_delay_us"):
        make_agent("negative", -1)
