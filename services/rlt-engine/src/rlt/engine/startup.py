"""Start-up you can watch: one log line per phase of building an engine, with its seconds.

    start-up: weights: 2.9 GB on cuda:0 (projections bfloat16) in 3.8 s
    start-up: memory profiling: activations ... in 6.1 s
    start-up: KV pool: 36,864 blocks of 16 positions x 4 planes = 147,456 tokens; ...
    start-up: CUDA graphs: 16 decode ticks, 7 prefill buckets in 9.4 s
    start-up: engine ready in 21.0 s

Graph capture reports its progress on the way (rlt_runner logs one line per captured graph
at INFO under `rlt_runner`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("rlt.startup")


def configure_logging(level: str, process: str) -> None:
    """Log lines of one process of `rlt serve` (core, api, fe<i>, supervisor), with the time."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s.%(msecs)03d %(levelname)s %(name)s [{process}]: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


class StartupClock:
    """Times the phases of one engine start (`phase`) and the whole (`ready`)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, detail=lambda: "") -> Iterator[None]:
        """Log `name`, what `detail()` says after the phase, and the phase's seconds."""
        started = time.perf_counter()
        yield
        seconds = self.phases[name] = time.perf_counter() - started
        said = detail()
        logger.info("start-up: %s%s in %.1f s", name, f": {said}" if said else "", seconds)

    def ready(self, what: str = "engine ready") -> float:
        seconds = time.perf_counter() - self.started
        logger.info("start-up: %s in %.1f s", what, seconds)
        return seconds


def restore_kernel_choices(cache_dir, device) -> int:
    """Before the first forward pass on CUDA: the kernel choices an earlier start measured
    (`rlt_models.kernel_choice_cache`); returns how many were read."""
    if cache_dir is None or device.type != "cuda":
        return 0
    from rlt_models import kernel_choice_cache

    restored = kernel_choice_cache.load(cache_dir, device)
    if restored:
        logger.info(
            "start-up: %d kernel choices from %s",
            restored,
            kernel_choice_cache.cache_file(cache_dir, device),
        )
    return restored


def keep_kernel_choices(cache_dir, device, restored: int) -> None:
    """After the warm-up measured every decode shape: write the choices for the next start
    when this one measured any (a cache directory that cannot be written is only logged)."""
    if cache_dir is None or device.type != "cuda":
        return
    from rlt_models import kernel_choice_cache

    try:
        path = kernel_choice_cache.save(cache_dir, device)
    except OSError as error:
        logger.warning("start-up: kernel choices not kept in %s (%s)", cache_dir, error)
        return
    if path is not None and kernel_choice_cache.count(device) > restored:
        logger.info("start-up: kernel choices kept in %s for the next start", path)
