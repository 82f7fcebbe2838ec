"""The LoRA kernel and runner tests again at each x86 level below this CPU's own (as an older
CPU runs them: SPLITSERVE_CPU_LEVEL caps the probe and the library's compiler target), in a
fresh process; a level the CPU lacks is skipped, named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from worker_svc import cpu_caps  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CAPS = cpu_caps.capabilities()
NATIVE_TESTS = "kernel or native or decode_stack"


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_lora_native_tests_pass_at_level(level):
    rank = cpu_caps.LEVELS.index
    if rank(level) > rank(CAPS.level):
        pytest.skip(f"the {level} level: this run has {CAPS.level} (the CPU {CAPS.cpu_level})")
    if level == CAPS.level:
        pytest.skip(f"the {level} level is this run's own: the tests ran at it already")
    env = {**os.environ, cpu_caps.ENV_VAR: level, "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return proc.stdout[-3000:]

    library = run("-c", "from worker_svc import native_attention as n; print(n.load().path.name)")
    assert f"-{level}-" in library  # the library built for the level
    files = [f"tests/unit/worker/test_lora_{name}.py" for name in ("kernel", "runner")]
    out = run("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files, "-k", NATIVE_TESTS)
    assert "SKIPPED" not in out and " passed" in out, out
