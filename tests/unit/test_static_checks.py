"""The static checks CI asks for, run inside the test suite (CI runs `make test`): `ruff check`,
`ruff format --check` over the project, and mypy, strict on the scheduler core (configured in
pyproject.toml's [tool.mypy]). Each is skipped when its tool is not installed (the dev extras)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _run(args: list[str]) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")


def test_ruff_check():
    _require("ruff")
    rc, out = _run(["ruff", "check", "--no-cache", "."])
    assert rc == 0, f"`ruff check .` failed (rc={rc}); `ruff check --fix` fixes some:\n{out}"


def test_ruff_format():
    _require("ruff")
    rc, out = _run(["ruff", "format", "--check", "--no-cache", "."])
    assert rc == 0, f"`ruff format --check .` failed (rc={rc}); run `ruff format`:\n{out}"


def test_mypy_strict_scheduler_core(tmp_path):
    _require("mypy")
    # the paths are the ones pyproject.toml's [tool.mypy] `files` lists (the core is strict
    # there); a fresh cache dir: nothing is written into the tree, runs never share a cache
    rc, out = _run(
        [
            "mypy",
            "--config-file",
            "pyproject.toml",
            "--cache-dir",
            str(tmp_path / "mypy_cache"),
            "scheduler_svc/core",
            "common/messages.py",
        ]
    )
    assert rc == 0, f"mypy (strict on scheduler_svc/core) failed (rc={rc}):\n{out}"
