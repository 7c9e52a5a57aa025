"""`/metrics` of several front ends (`rlt serve --api-server-count N`): one prometheus-client
multi-process directory per server, owned by the supervisor.

    supervisor                        front end i (each scrape of any of them)
    ----------                        -----------------------------------------
    FrontEndMetrics(): a fresh temp   its HTTP counters and histograms live in files of the
      directory, PROMETHEUS_MULTIPROC   directory (`rlt_serve.metrics`); a scrape sums every
      _DIR set before any front end     front end's files (MultiProcessCollector) and reads the
      starts (inherited)                core's statistics fresh (never summed)
    front_end_gone(pid): a dead
      front end's live gauges go;     so two successive scrapes, whichever front ends answer,
      its counters stay in the sums     show the same totals, and counters never go back
    close(): the directory removed

How vLLM runs several API servers (its PROMETHEUS_MULTIPROC_DIR set up), done here with
prometheus-client's documented multi-process mode.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from rlt_serve.metrics import MULTIPROCESS_DIR_VARIABLE, mark_front_end_gone


class FrontEndMetrics:
    """The multi-process metrics directory of one supervised server (create it before the
    front ends start: they find it in their environment)."""

    def __init__(self) -> None:
        self._previous = os.environ.get(MULTIPROCESS_DIR_VARIABLE)
        self.path = tempfile.mkdtemp(prefix="rlt-metrics-")
        os.environ[MULTIPROCESS_DIR_VARIABLE] = self.path

    def front_end_gone(self, pid: int) -> None:
        """A front end exited: drop its live gauges (its counts stay in the totals)."""
        mark_front_end_gone(pid, self.path)

    def close(self) -> None:
        """Remove the directory and restore the environment (idempotent)."""
        if os.environ.get(MULTIPROCESS_DIR_VARIABLE) == self.path:
            if self._previous is None:
                del os.environ[MULTIPROCESS_DIR_VARIABLE]
            else:
                os.environ[MULTIPROCESS_DIR_VARIABLE] = self._previous
        shutil.rmtree(self.path, ignore_errors=True)
