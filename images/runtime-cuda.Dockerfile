# The vSkipper CUDA runtime: the upstream SGLang release image of the pinned version (its CUDA build, with its own
# CUDA torch and SGLang's CUDA kernel packages), pinned by digest, plus the vSkipper wheel, its tile tables and the
# entrypoint the operator's pods start through. Build it where the image can be pulled (not built by `make images`
# or `make test` here; tests/test_images.py lints it and checks its pins):
#   docker build -f images/runtime-cuda.Dockerfile -t vskipper-runtime:cuda \
#       --build-arg SGLANG_IMAGE_DIGEST=sha256:<the digest of lmsysorg/sglang:v0.5.21> .
# Find the digest with `docker buildx imagetools inspect lmsysorg/sglang:v0.5.21` (or `crane digest`) and check it
# against the release. The default below is deliberately not a digest: without --build-arg SGLANG_IMAGE_DIGEST the
# build stops at FROM with "invalid reference format" naming it.
# Stage 1 builds the vSkipper wheel (no dependencies resolved); stage 2 installs it into the upstream image under
# the base's own versions as constraints (pip fails instead of replacing the base's torch or SGLang), checks the
# pins, applies images/runtime/patches and bakes the tile tables. Its bandwidth-probe Jobs run
# `python -m vskipper_operator.probe`, its download init containers `python -m vskipper.fetch` (huggingface_hub
# ships with SGLang).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.21
ARG SGLANG_IMAGE_DIGEST=sha256:set-SGLANG_IMAGE_DIGEST-to-the-digest-of-lmsysorg-sglang-v0.5.21

FROM ${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST} AS wheel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vskipper ./vskipper
COPY operator ./operator
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST}
ARG SGLANG_VERSION=0.5.21
ARG TORCH_VERSION=2.13.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/vskipper
COPY --from=wheel /wheels /opt/vskipper/wheels
COPY images/runtime/patches /opt/vskipper/patches
COPY images/runtime/tile_tables /opt/vskipper/tile_tables
COPY images/runtime/entrypoint.py /usr/local/bin/vskipper-entrypoint

# The base's versions are the lock: vSkipper's runtime extra may add packages, never replace the base's.
RUN python3 -c "import importlib.metadata as m, sys; v = m.version('sglang'); sys.exit(0 if v == '${SGLANG_VERSION}' else f'base image has sglang {v}, expected ${SGLANG_VERSION}')" \
    && python3 -m pip freeze --exclude-editable > /opt/vskipper/base-constraints.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir -c /opt/vskipper/base-constraints.txt \
        "$(ls /opt/vskipper/wheels/*.whl)[runtime]" \
    && python3 -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '${TORCH_VERSION}' and torch.version.cuda else f'torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CUDA build of ${TORCH_VERSION}')"

# Patches against the installed sglang package; the build fails when one does not apply.
RUN site="$(python3 -c 'import os, sglang; print(os.path.dirname(os.path.dirname(sglang.__file__)))')"; \
    for p in /opt/vskipper/patches/*.patch; do \
        [ -e "$p" ] || continue; echo "applying $p"; patch -d "$site" -p1 --forward < "$p"; \
    done

# Tile tables: the package's own plus the tuned ones from images/runtime/tile_tables; the non-root user.
RUN tables="$(python3 -c 'from vskipper.mixed.tiles import TABLE_DIR; print(TABLE_DIR)')" \
    && find /opt/vskipper/tile_tables -name '*.json' -exec cp {} "$tables"/ \; \
    && chmod 0755 /usr/local/bin/vskipper-entrypoint \
    && useradd --uid 10001 --create-home --home-dir /home/vskipper vskipper

USER 10001:10001
WORKDIR /home/vskipper
EXPOSE 30000
ENTRYPOINT ["/usr/local/bin/vskipper-entrypoint"]
