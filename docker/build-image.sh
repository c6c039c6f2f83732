#!/usr/bin/env bash
# `make image`: build the elastictrain image where no image registry is reachable.
#
# The base is a Debian bookworm root file system made here with debootstrap (Debian's mirror is
# reachable) and turned into an image with `docker import`; the Dockerfile then builds on it with
# `docker build --network=host`, so pip and apt inside reach the package registries as this machine
# does. Two things of this machine go into the build context (docker/extra/, ignored by git): its CA
# bundle (a TLS-intercepting proxy's CA, if any, is in it) and the CPU build of torch from pip's
# local wheel folder, which PyPI does not serve (its torch bundles CUDA, several GB). Elsewhere the
# Dockerfile builds on the public python image without either.
set -euo pipefail
IMAGE=${1:-elastictrain:0.1.0-cpu}
BASE=${2:-elastictrain-base:bookworm}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EXTRA="$ROOT/docker/extra"

say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*"; }
command -v docker >/dev/null || { echo "make image: no docker client (apt-get install docker.io)" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "make image: no Docker engine answers; start dockerd (as root)" >&2; exit 2; }

if docker image inspect "$BASE" >/dev/null 2>&1; then
  say "base image $BASE present"
else
  if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "make image: debootstrap missing and not root (apt-get install debootstrap)" >&2; exit 2; }
    apt-get install -y -qq debootstrap
  fi
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap bookworm (minbase + python3, python3-venv, ca-certificates) into $rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  say "imported $BASE ($(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1/1e6}'))"
fi

rm -rf "$EXTRA/wheels" "$EXTRA/ca-certificates.crt"
mkdir -p "$EXTRA/wheels"
[ -s /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$EXTRA/ca-certificates.crt"
for links in ${PIP_FIND_LINKS:-} $(pip3 config get global.find-links 2>/dev/null || true) /opt/wheels; do
  found=$(ls "$links"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$found" ]; then cp "$found" "$EXTRA/wheels/"; say "torch CPU wheel from $links"; break; fi
done

say "docker build --network=host -t $IMAGE (on $BASE)"
docker build --network=host --build-arg PYTHON_IMAGE="$BASE" -t "$IMAGE" "$ROOT"
say "built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
