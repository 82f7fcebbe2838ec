"""Garbage-collector settings for a long-running scheduler process (opt-in, process-wide).

Each decode step allocates a few small container objects per running request (the diff entries,
the RequestOutputs and their lists). With CPython's default gen0 threshold (700 allocations) and
~1000 running requests, most of them are still alive when a young collection runs, so they are
promoted and trigger full collections that walk every live object (KV blocks, waiting requests):
the cost per request then grows with the batch and with the waiting queue (bench/
scheduler_overhead.py shows it). A large gen0 threshold lets them die young, and freezing what
exists after startup keeps the long-lived objects out of later collections. Neither core calls
this itself; a service's main() (scheduler or worker) may, once it is set up.
"""

from __future__ import annotations

import gc

DEFAULT_GEN0_THRESHOLD = 50_000


def tune_gc_for_serving(
    gen0_threshold: int = DEFAULT_GEN0_THRESHOLD, freeze: bool = True
) -> tuple[int, int, int]:
    """Collect once, optionally freeze the survivors, raise the gen0 threshold. Returns the old
    thresholds (for restore_gc)."""
    old = gc.get_threshold()
    gc.collect()
    if freeze:
        gc.freeze()
    gc.set_threshold(gen0_threshold, old[1], old[2])
    return old


def restore_gc(thresholds: tuple[int, int, int]) -> None:
    """Undo tune_gc_for_serving (tests, benchmarks)."""
    gc.unfreeze()
    gc.set_threshold(*thresholds)
