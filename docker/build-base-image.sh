#!/usr/bin/env bash
# Build a minimal Debian bookworm base image with Python 3.11 (`python3`, venv support) from a
# Debian package mirror, for machines that reach a Debian mirror but no image registry.
#
#   docker/build-base-image.sh [IMAGE_TAG]          # default localbase/python:3.11
#   MIRROR=http://deb.debian.org/debian docker/build-base-image.sh
#
# Then: BASE_IMAGE=localbase/python:3.11 docker/build-images.sh (or make images).
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail

TAG="${1:-${BASE_IMAGE_TAG:-localbase/python:3.11}}"
SUITE="${SUITE:-bookworm}"

if [[ -z "${MIRROR:-}" ]]; then
    # The mirror apt already uses: deb822 `URIs:` lines first, then one-line `deb URL SUITE ...`.
    MIRROR="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{print $2}' | grep -v -- '-security' | head -n1 || true)"
    if [[ -z "$MIRROR" ]]; then
        MIRROR="$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' \
            | grep -v -- '-security' | head -n1 || true)"
    fi
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi

command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "no Docker engine reachable" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }

ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/splitserve-rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR"

# Trim what a runtime image never reads.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/*.log "$ROOTFS"/var/cache/debconf/*-old
find "$ROOTFS"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true

tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
docker run --rm "$TAG" python3 -c 'import sys, venv, ensurepip; print("base ok:", sys.version.split()[0])'
docker image ls "$TAG"
