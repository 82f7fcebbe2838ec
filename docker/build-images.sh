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

for service in scheduler worker; do
    start=$(date +%s)
    docker build -f "docker/$service.Dockerfile" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" \
        -t "splitserve-$service:$TAG" .
    size=$(docker image inspect -f '{{.Size}}' "splitserve-$service:$TAG")
    echo "splitserve-$service:$TAG built in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
done
