# The vSkipper runtime: SGLang pinned to the release the integration targets, the vSkipper package (skippers,
# mixed-depth kernels, switch) with its SGLang plugin, patches applied at build time, tile tables baked in.
#   docker build -f images/runtime.Dockerfile -t vskipper-runtime \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04 .
# BASE_IMAGE: a CUDA (or SGLang) base with python3 and its venv module. TORCH_INDEX_URL selects the torch build
# (the CUDA wheels in production; the CPU index for a CPU build that exercises the Python layer).
# Launch: the entrypoint (runtime/entrypoint.py) execs `vskipper serve` with the container's arguments, the
# `vskipper serve` flags; the operator plans its server pods with no `command`, so they start exactly this way.
# Its bandwidth-probe Jobs run `python -m vskipper_operator.probe` in this image (hence operator/ below).
ARG BASE_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.21
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129
# torch's own dependencies (filelock, sympy, ...) when the torch index carries torch alone.
ARG TORCH_EXTRA_INDEX_URL=https://pypi.org/simple
ARG INSTALL_SGLANG=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH HOME=/home/vskipper
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vskipper ./vskipper
COPY operator ./operator
COPY images/runtime/patches /opt/vskipper/patches
COPY images/runtime/tile_tables /opt/vskipper/tile_tables
COPY images/runtime/entrypoint.py /usr/local/bin/vskipper-entrypoint

# torch first and alone, pinned, from the chosen index; then SGLang pinned; then vSkipper's runtime extra.
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url "${TORCH_EXTRA_INDEX_URL}" \
        "torch==${TORCH_VERSION}" \
    && if [ "${INSTALL_SGLANG}" = "1" ]; then pip install --no-cache-dir "sglang==${SGLANG_VERSION}"; fi \
    && pip install --no-cache-dir "./[runtime]" \
    && python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '${TORCH_VERSION}' else f'torch {v} replaced ${TORCH_VERSION}')"

# Patches against the installed sglang package; the build fails when one does not apply.
RUN if [ "${INSTALL_SGLANG}" = "1" ]; then \
        site="$(python -c 'import os, sglang; print(os.path.dirname(os.path.dirname(sglang.__file__)))')"; \
        python -c "import importlib.metadata as m, sys; v = m.version('sglang'); sys.exit(0 if v == '${SGLANG_VERSION}' else f'sglang {v} != ${SGLANG_VERSION}')"; \
        for p in /opt/vskipper/patches/*.patch; do \
            [ -e "$p" ] || continue; echo "applying $p"; patch -d "$site" -p1 --forward < "$p"; \
        done; \
    fi

# Tile tables: the package's own plus the tuned ones from images/runtime/tile_tables.
RUN tables="$(python -c 'from vskipper.mixed.tiles import TABLE_DIR; print(TABLE_DIR)')" \
    && find /opt/vskipper/tile_tables -name '*.json' -exec cp {} "$tables"/ \; \
    && chmod 0755 /usr/local/bin/vskipper-entrypoint \
    && useradd --uid 10001 --create-home --home-dir /home/vskipper vskipper

USER 10001:10001
WORKDIR /home/vskipper
EXPOSE 30000
ENTRYPOINT ["/usr/local/bin/vskipper-entrypoint"]
