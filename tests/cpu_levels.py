"""Skip marks for tests that need a CPU level: they ask the probe the worker uses (cpu_caps),
so a run capped with SPLITSERVE_CPU_LEVEL skips what an AVX2-only machine would, naming it.
Where the level is there, the kernels for it must be too: a missing one fails, not skips."""

from __future__ import annotations

import pytest

from worker_svc import native_attention
from worker_svc.cpu_caps import capabilities

CAPS = capabilities()
NATIVE_LIBRARY = native_attention.load() is not None


def needs_level(level: str, what: str = "") -> pytest.MarkDecorator:
    """Skip unless the usable CPU level is `level` or above and the native library loads."""
    runs = f"{CAPS.level} (capped from {CAPS.cpu_level})" if CAPS.capped else CAPS.level
    if not CAPS.has(level):
        reason = f"needs the {level} CPU level{' for ' + what if what else ''}; this run has {runs}"
        return pytest.mark.skipif(True, reason=reason)
    return pytest.mark.skipif(
        not NATIVE_LIBRARY, reason="no native library (no C compiler and no prebuilt one)"
    )
