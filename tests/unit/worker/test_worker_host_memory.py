"""The worker keeps freed activations in its heap: large tensors reallocated step after step
stop page-faulting in from the kernel."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SNIPPET = """
import resource, sys, torch
from worker_svc.host_memory import keep_freed_memory
threshold = 0
if sys.argv[1] == "tuned":
    threshold = keep_freed_memory()
    assert keep_freed_memory() == threshold  # once per process
size = 12 << 20  # floats: 48 MiB, above glibc's largest automatic mmap threshold (32 MiB)
for _ in range(10):  # warm up: the heap settles after a few rounds
    torch.ones(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # filled and freed, as a large activation step after step
    torch.ones(size)
print(threshold, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    threshold, faults = out.stdout.strip().splitlines()[-1].split()
    return int(threshold or 0), int(faults)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc"
)
def test_freed_activations_are_reused_without_page_faults():
    (_, default), (threshold, tuned) = _faults("default"), _faults("tuned")
    pages = 20 * (48 << 20) // 4096
    assert default > pages // 2  # glibc's default: every 48 MiB tensor comes from fresh mmap pages
    if threshold < 48 << 20:
        pytest.skip(f"this glibc caps the mmap threshold at {threshold} bytes")
    assert tuned < pages // 50  # kept in the heap and reused


def test_runner_config_turns_it_on_by_default():
    from worker_svc.config import ModelRunnerConfig

    assert ModelRunnerConfig().keep_freed_memory is True
