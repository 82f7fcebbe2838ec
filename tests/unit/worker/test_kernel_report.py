"""What a worker says it runs: `--print-capabilities`, and the kernels line it registers with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tests.cpu_levels import CAPS, needs_level  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.kernel_report import kernel_choices  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402


def print_capabilities(level: str) -> dict[str, str]:
    env = {**os.environ, "SPLITSERVE_CPU_LEVEL": level}
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "worker", "--print-capabilities"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    choices = dict(kernel_choices())
    table = {}
    for line in out.splitlines():
        op = next(op for op in choices if line.startswith(op + " "))
        table[op] = line[len(op) :].strip()
    return table


@needs_level("avx2", "the AVX2 kernels' report")
def test_print_capabilities_at_avx2_names_the_avx2_kernels():
    """What an AVX2-only CPU runs: no oneDNN or AMX for bfloat16, SDPA for prefill chunks; the
    AVX2 build's fused elementwise ops and, with them, the float32 decode stack."""
    table = print_capabilities("avx2")
    assert table["cpu level"].endswith("avx2") or "avx2 (capped" in table["cpu level"]
    assert table["linear float32"] == "native packed GEMM"
    assert table["linear bfloat16"] == "native packed GEMM, bfloat16 widened to float32"
    assert table["prefill attention"] == "torch SDPA per chunk"
    assert table["norms, rotary, SiLU product, argmax"] == "native fused"
    assert table["pure-decode steps"].startswith("native decode stack (float32)")
    assert "avx2" in table["native library"]


def test_print_capabilities_at_this_level_is_what_the_loaders_give():
    table = print_capabilities(CAPS.level)
    assert table == kernel_choices()


def test_runner_reports_the_level_and_kernels_it_took(tiny_llama_dir):
    runner = ModelRunner(
        ModelRunnerConfig(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=16)
    )
    words = dict(w.split("=") for w in runner.kernels.split()[1:])
    assert runner.kernels.split()[0] == CAPS.level
    assert words["linear"] == runner.linear_kind
    assert words["decode-attention"] == ("native" if runner.decode_kernel else "torch")
    assert words["prefill-attention"] == ("native" if runner.native_prefill else "sdpa")
    assert words["forward"] == runner.forward_path
