"""A NIXL agent whose progress thread sleeps when there is nothing to progress.

NIXL's Python API (`nixl._api.nixl_agent`, 1.5) pins its progress-thread delay (`pthrDelay`)
at 0 µs: the thread polls UCX without pause, one CPU core per agent even when idle (measured
with a delay: README.md, "Its agent's thread"). The delay is set by handing the API's
constructor a config class that keeps `pthrDelay` at our value (the binding's class,
subclassed, for the duration of one constructor call under a lock). Where the binding has no
such field (another NIXL version), the agent is built with NIXL's own config and a warning
says that its progress thread polls without pause.
"""

from __future__ import annotations

import logging
import threading

from rlt_pd.messages import PDTransportError

__all__ = ["DEFAULT_PROGRESS_DELAY_US", "make_agent"]

log = logging.getLogger(__name__)

# A 16-token transfer took 0.13 ms longer than with 0 (rlt-pd README): small beside a prefill.
DEFAULT_PROGRESS_DELAY_US = 100

_constructing = threading.Lock()


def _api():
    try:
        from nixl import _api
    except ImportError as error:  # pragma: no cover - the dependency is declared
        raise PDTransportError(f"the nixl package is not usable here: {error}") from error
    return _api


def make_agent(name: str, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US):
    """A `nixl_agent` with its progress thread on, no listener thread and no backend yet;
    `progress_delay_us` = 0 is NIXL's own behaviour (the thread never waits)."""
    if progress_delay_us < 0:
        raise ValueError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
    api = _api()
    config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
    binding = getattr(api, "nixlBind", None)
    native = getattr(binding, "nixlAgentConfig", None)
    if progress_delay_us == 0 or native is None or not hasattr(native(), "pthrDelay"):
        if progress_delay_us:
            log.warning(
                "this NIXL's agent config has no progress-thread delay: the progress thread "
                "of agent %r polls without pause (one CPU core)",
                name,
            )
        return api.nixl_agent(name, config)

    class _DelayedProgressConfig(native):
        def __setattr__(self, field: str, value) -> None:
            super().__setattr__(field, progress_delay_us if field == "pthrDelay" else value)

    with _constructing:
        binding.nixlAgentConfig = _DelayedProgressConfig
        try:
            return api.nixl_agent(name, config)
        finally:
            binding.nixlAgentConfig = native
