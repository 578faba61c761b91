#!/usr/bin/env bash
# `make images`: build the operator and loadgen images (and the runtime image with IMAGES=... runtime) for real.
#
# - Docker: uses $DOCKER_HOST when a daemon answers there; otherwise starts Debian's dockerd with its own data
#   root and socket under the cache folder (left running for the next build; stop it with `images/build.sh stop`).
# - Base: with no registry reachable, a Debian bookworm rootfs (python3, venv, ca-certificates, patch, passwd) is
#   made once with debootstrap, tarred into the cache and imported FROM scratch as vskipper-base:bookworm. The
#   host's CA bundle goes into the base, so pip inside the build trusts what the host trusts.
# Cache: $VSKIPPER_IMAGE_CACHE (default ~/.cache/vskipper-images).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${VSKIPPER_IMAGE_CACHE:-$HOME/.cache/vskipper-images}"
BASE_TAG="${BASE_TAG:-vskipper-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TAG="${IMAGE_TAG:-dev}"
IMAGES="${IMAGES:-operator loadgen}"
mkdir -p "$CACHE"

start_docker() {
    if docker info >/dev/null 2>&1; then return; fi
    export DOCKER_HOST="unix://$CACHE/docker.sock"
    if docker info >/dev/null 2>&1; then return; fi
    echo "starting dockerd (data root $CACHE/docker)"
    nohup dockerd --data-root "$CACHE/docker" --exec-root "$CACHE/exec" --pidfile "$CACHE/dockerd.pid" \
        --host "$DOCKER_HOST" --iptables=false --bridge=none >"$CACHE/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    echo "dockerd did not start; see $CACHE/dockerd.log" >&2
    exit 1
}

if [ "${1:-}" = "stop" ]; then
    [ -f "$CACHE/dockerd.pid" ] && kill "$(cat "$CACHE/dockerd.pid")"
    exit 0
fi

start_docker
if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    if [ ! -f "$CACHE/bookworm-python.tar" ]; then
        rm -rf "$CACHE/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,patch,passwd \
            bookworm "$CACHE/rootfs" "$MIRROR"
        if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
            cp /etc/ssl/certs/ca-certificates.crt "$CACHE/rootfs/etc/ssl/certs/ca-certificates.crt"
        fi
        rm -rf "$CACHE/rootfs/var/cache/apt/archives/"*.deb "$CACHE/rootfs/var/lib/apt/lists/"*
        tar -C "$CACHE/rootfs" -cf "$CACHE/bookworm-python.tar.tmp" . && mv "$CACHE/bookworm-python.tar.tmp" "$CACHE/bookworm-python.tar"
        rm -rf "$CACHE/rootfs"
    fi
    printf 'FROM scratch\nADD bookworm-python.tar /\nENV LANG=C.UTF-8\nCMD ["/bin/bash"]\n' |
        docker build --network host -t "$BASE_TAG" -f - "$CACHE"
fi

for image in $IMAGES; do
    echo "building vskipper-$image:$TAG"
    extra=()
    if [ "$image" = runtime ]; then
        extra=(--build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
    fi
    docker build --network host --build-arg "BASE_IMAGE=$BASE_TAG" "${extra[@]}" \
        -f "images/$image.Dockerfile" -t "vskipper-$image:$TAG" .
done
