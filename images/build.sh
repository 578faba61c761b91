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
    if [ ! -f "$CACHE/base/bookworm-python.tar" ]; then
        rm -rf "$CACHE/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,patch,passwd \
            bookworm "$CACHE/rootfs" "$MIRROR"
        if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
            cp /etc/ssl/certs/ca-certificates.crt "$CACHE/rootfs/etc/ssl/certs/ca-certificates.crt"
        fi
        rm -rf "$CACHE/rootfs/var/cache/apt/archives/"*.deb "$CACHE/rootfs/var/lib/apt/lists/"*
        mkdir -p "$CACHE/base"
        tar -C "$CACHE/rootfs" -cf "$CACHE/base/bookworm-python.tar.tmp" . && mv "$CACHE/base/bookworm-python.tar.tmp" "$CACHE/base/bookworm-python.tar"
        rm -rf "$CACHE/rootfs"
    fi
    printf 'FROM scratch\nADD bookworm-python.tar /\nENV LANG=C.UTF-8\nCMD ["/bin/bash"]\n' |
        docker build --network host -t "$BASE_TAG" -f - "$CACHE/base"  # the tar alone: never the daemon's data root
fi

# The runtime image here: the CPU torch wheel the machines carry ($TORCH_WHEEL_DIR), served on loopback as a
# one-package index, and no SGLang (its CUDA wheels are out of reach; INSTALL_SGLANG=1 to try). Production builds
# pass TORCH_INDEX_URL (the CUDA wheels) and keep INSTALL_SGLANG=1.
index_pid=""
trap 'if [ -n "$index_pid" ]; then kill "$index_pid"; fi' EXIT
runtime_args() {  # sets `extra` (no subshell: the index server's pid must stay in this shell)
    local url="${TORCH_INDEX_URL:-}"
    if [ -z "$url" ]; then
        local wheel port
        wheel="$(ls "${TORCH_WHEEL_DIR:-/opt/wheels}"/torch-*+cpu-*.whl | head -1)"
        rm -rf "$CACHE/torch-index" && mkdir -p "$CACHE/torch-index/torch"
        ln "$wheel" "$CACHE/torch-index/torch/" 2>/dev/null || cp "$wheel" "$CACHE/torch-index/torch/"
        port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        python3 -m http.server --bind 127.0.0.1 --directory "$CACHE/torch-index" "$port" >/dev/null 2>&1 &
        index_pid=$!
        sleep 1
        url="http://127.0.0.1:$port/"
    fi
    extra=(--build-arg "TORCH_INDEX_URL=$url" --build-arg "INSTALL_SGLANG=${INSTALL_SGLANG:-0}")
}

for image in $IMAGES; do
    echo "building vskipper-$image:$TAG"
    extra=()
    if [ "$image" = runtime ]; then
        runtime_args
    fi
    docker build --network host --build-arg "BASE_IMAGE=$BASE_TAG" "${extra[@]}" \
        -f "images/$image.Dockerfile" -t "vskipper-$image:$TAG" .
done
