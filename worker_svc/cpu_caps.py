"""What this CPU can run, probed once: the level the native kernels are built for and chosen by.

Levels, lowest first: `none` (no AVX2: torch only), `avx2` (AVX2 + FMA, x86-64-v3), `avx512`
(x86-64-v4), `avx512-bf16` (+ AVX512-BF16 dot products), `amx` (+ AMX-BF16 tiles). Each
level includes the ones below it. `SPLITSERVE_CPU_LEVEL` caps the level below what the CPU has
(never above): CI runs the worker's tests capped at `avx2`, so code that assumes AVX-512 or AMX
shows up on any machine. Everything that depends on an instruction set asks `probe()`: the
kernel build, the choice of linear layers, and the tests' skip marks.

Standard library only (the image build runs kernel_build.py, which imports this, on the host).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

LEVELS = ("none", "avx2", "avx512", "avx512-bf16", "amx")
ENV_VAR = "SPLITSERVE_CPU_LEVEL"

# /proc/cpuinfo flags each level adds to the one below it
_LEVEL_FLAGS = {
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "avx512-bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_tile", "amx_bf16"}),
}
# the compiler's target for a level below the CPU's own (its own level builds -march=native).
# AVX512-BF16 and AMX code is compiled by target attribute and chosen at run time: the Python
# side turns it off above the usable level (native_attention, amx_gemm).
_MARCH = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512-bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "amx": ["-march=sapphirerapids"],
}


class CpuLevelError(ValueError):
    """SPLITSERVE_CPU_LEVEL names no level."""


@dataclass(frozen=True, slots=True)
class CpuCapabilities:
    cpu_level: str  # what the CPU has
    level: str  # what the kernels may use: cpu_level, or lower where capped
    flags: frozenset[str] = field(repr=False)
    model_name: str = ""

    @property
    def capped(self) -> bool:
        return self.level != self.cpu_level

    def has(self, level: str) -> bool:
        """True where `level` is at or below the usable level."""
        return LEVELS.index(self.level) >= _index(level)

    def compiler_flags(self) -> list[str]:
        """-march for the native kernels at the usable level ([] at `none`)."""
        if self.level == "none":
            return []
        return ["-march=native"] if not self.capped else portable_flags(self.level)

    def describe(self) -> str:
        capped = f" (capped by {ENV_VAR}; the CPU has {self.cpu_level})" if self.capped else ""
        return f"{self.model_name or platform.machine()}: {self.level}{capped}"


def portable_flags(level: str) -> list[str]:
    """-march for any CPU of `level` (a prebuilt library, or a level capped below the CPU's)."""
    return list(_MARCH[level])


def level_of(flags: frozenset[str]) -> str:
    """The highest level whose flags, and all lower levels' flags, are in `flags`."""
    reached = "none"
    for level in LEVELS[1:]:
        if not _LEVEL_FLAGS[level] <= flags:
            break
        reached = level
    return reached


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[frozenset[str], str]:
    """The first processor's flags and model name ((empty, "") where there is no cpuinfo)."""
    flags: frozenset[str] = frozenset()
    model = ""
    try:
        text = path.read_text()
    except OSError:
        return flags, model
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        if flags and model:
            break
    return flags, model


def probe(env: dict[str, str] | None = None) -> CpuCapabilities:
    """This machine's capabilities, capped by SPLITSERVE_CPU_LEVEL where set."""
    on_x86 = platform.machine() in ("x86_64", "AMD64")
    flags, model = read_cpuinfo() if on_x86 else (frozenset(), "")
    cpu_level = level_of(flags)
    cap = (os.environ if env is None else env).get(ENV_VAR, "").strip().lower()
    level = cpu_level
    if cap:
        level = LEVELS[min(_index(cap), LEVELS.index(cpu_level))]
    return CpuCapabilities(cpu_level=cpu_level, level=level, flags=flags, model_name=model)


def _index(level: str) -> int:
    try:
        return LEVELS.index(level)
    except ValueError:
        raise CpuLevelError(
            f"unknown CPU level {level!r} (in {ENV_VAR}?); choose one of {', '.join(LEVELS)}"
        ) from None


_probed: CpuCapabilities | None = None


def capabilities() -> CpuCapabilities:
    """probe(), once per process."""
    global _probed
    if _probed is None:
        _probed = probe()
    return _probed
