"""Compile the worker's CPU kernels (worker_svc/csrc/: paged attention, packed GEMM, fused
elementwise ops, the LoRA product) into one library: for this CPU's level (worker_svc/cpu_caps.py;
-march=native unless SPLITSERVE_CPU_LEVEL caps it, at a worker's first start) or for portable
x86-64 levels ahead of time (images without a compiler). Standard library only, so an image
build script can run it on the host:

    python3 -m worker_svc.kernel_build --prebuild worker_svc/prebuilt_kernels
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker_svc import cpu_caps

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.c",
        "paged_decode_bf16.c",
        "paged_decode_avx2.c",
        "kv_write.c",
        "paged_prefill.c",
        "paged_prefill_avx512.c",
        "packed_gemm.c",
        "fused_ops.c",
        "fused_ops_avx2.c",
        "amx_gemm.c",
        "decode_stack.c",
        "token_mask.c",
        "lora.c",
    )
)
HEADERS = (
    CSRC / "simd_math.h",
    CSRC / "fused_ops_entries.h",
    CSRC / "amx_tiles.h",
    CSRC / "work_runs.h",
    CSRC / "paged_attention.h",
    CSRC / "paged_prefill.h",
)
LIBRARY_PREFIX = "cpu_kernels"
PREBUILT_DIR = Path(__file__).with_name("prebuilt_kernels")
# No -ffast-math: it links crtfastmath.o, which turns on flush-to-zero for the whole process
# that loads the library. The reassociation the plain loops need comes alone.
COMMON_FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
]
# the levels a prebuilt library is made for, best first (the worker image has no compiler)
PORTABLE_LEVELS = ("avx512", "avx2")


def source_bytes() -> bytes:
    return b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))


def source_key() -> str:
    return hashlib.sha256(source_bytes()).hexdigest()[:16]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_to(path: Path, flags: list[str]) -> Path:
    """Compile SOURCES into `path` (atomically: concurrent workers never load a partial file)."""
    cc = compiler()
    if not cc:
        raise RuntimeError(f"no C compiler found and no prebuilt {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_path = Path(tmp) / path.name
        subprocess.run(
            [cc, *flags, *map(str, SOURCES), "-o", str(tmp_path), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp_path, path)
    return path


def level_flags(caps: cpu_caps.CpuCapabilities) -> list[str]:
    """The full compiler command's flags for `caps`' usable level."""
    return [*caps.compiler_flags(), *COMMON_FLAGS]


def native_build(cache: Path, caps: cpu_caps.CpuCapabilities | None = None) -> Path:
    """The library for this CPU's usable level in `cache`, compiled first if it is not there.
    The name hashes the source, the flags and the CPU's features (not the compiler's path), so
    a worker without a compiler still loads one built for this CPU into a shared cache."""
    caps = caps or cpu_caps.capabilities()
    if caps.level == "none":
        raise RuntimeError("this CPU has no AVX2 + FMA: the native kernels need at least that")
    flags = level_flags(caps)
    key = hashlib.sha256(
        source_bytes() + " ".join([*flags, *sorted(caps.flags)]).encode()
    ).hexdigest()[:16]
    path = cache / f"{LIBRARY_PREFIX}-{caps.level}-{key}.so"
    return path if path.exists() else compile_to(path, flags)


def prebuilt_name(level: str) -> str:
    return f"{LIBRARY_PREFIX}-{level}-{source_key()}.so"


def prebuild(out_dir: Path) -> list[Path]:
    """One library per portable level for this source (old ones of other sources removed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = {prebuilt_name(level) for level in PORTABLE_LEVELS}
    for old in out_dir.glob("*.so"):
        if old.name not in keep:
            old.unlink()
    return [
        compile_to(out_dir / prebuilt_name(level), [*cpu_caps.portable_flags(level), *COMMON_FLAGS])
        for level in PORTABLE_LEVELS
    ]


def find_prebuilt(directory: Path, caps: cpu_caps.CpuCapabilities) -> Path | None:
    """The best prebuilt library of this source that `caps` allows, if any."""
    for level in PORTABLE_LEVELS:
        path = directory / prebuilt_name(level)
        if caps.has(level) and path.exists():
            return path
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prebuild", type=Path, default=PREBUILT_DIR, metavar="DIR")
    args = parser.parse_args()
    for path in prebuild(args.prebuild):
        print(path)


if __name__ == "__main__":
    main()
