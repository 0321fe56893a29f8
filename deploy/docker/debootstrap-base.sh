#!/usr/bin/env bash
# A Debian bookworm base image with Python 3.11 as `python`, made with debootstrap and imported into docker or
# podman — for building sharp's CPU image where no registry is reachable:
#   deploy/docker/debootstrap-base.sh [TAG]     (default localhost/sharp-python:3.11-bookworm; needs root)
#   make image IMAGE_ARGS='--build-arg PYTHON_IMAGE=localhost/sharp-python:3.11-bookworm'
set -euo pipefail
tag=${1:-localhost/sharp-python:3.11-bookworm}
engine=${ENGINE:-$(command -v docker || command -v podman || true)}
mirror=${MIRROR:-http://deb.debian.org/debian}
[ -n "$engine" ] || { echo "debootstrap-base.sh: needs docker or podman" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "debootstrap-base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | "$engine" import - "$tag"
echo "$tag"
