#!/usr/bin/env bash
# Build both images: splitserve-scheduler and splitserve-worker (the tags docker-compose.yml uses).
#
#   docker/build-images.sh                          # base python:3.11-slim
#   BASE_IMAGE=localbase/python:3.11 docker/build-images.sh
#   WHEELHOUSE=0 docker/build-images.sh             # do not refresh docker/wheelhouse/ first
#
# By default it first brings docker/wheelhouse/ up to date (docker/wheelhouse.sh, on the host),
# so the build itself needs no network; with WHEELHOUSE=0 and an empty wheelhouse the build
# installs from PyPI instead. Classic builder and BuildKit both work.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
TAG="${SPLITSERVE_IMAGE_TAG:-latest}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

if [[ "${WHEELHOUSE:-1}" != 0 ]]; then
    docker/wheelhouse.sh
fi

# The worker image has no C compiler: ship the CPU kernels (attention, GEMM, fused ops) prebuilt
# for portable x86-64 levels (the worker picks the best its CPU runs; without one it takes the
# torch and MKL paths).
if [[ "$(uname -m)" == x86_64 ]] && command -v "${CC:-cc}" >/dev/null 2>&1; then
    python3 -m worker_svc.kernel_build --prebuild worker_svc/prebuilt_kernels
else
    echo "no C compiler on this host: the worker image gets no prebuilt CPU kernels" >&2
fi

for service in scheduler worker; do
    start=$(date +%s)
    docker build -f "docker/$service.Dockerfile" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" \
        -t "splitserve-$service:$TAG" .
    size=$(docker image inspect -f '{{.Size}}' "splitserve-$service:$TAG")
    echo "splitserve-$service:$TAG built in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
done
