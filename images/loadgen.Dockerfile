# The vSkipper load generator (open-loop Poisson clients, A/B and ladder runs, reports). No torch. Non-root.
#   docker build -f images/loadgen.Dockerfile -t vskipper-loadgen .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vskipper ./vskipper
COPY loadgen ./loadgen
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "./[loadgen]" \
    && python -c "import importlib.util, sys; sys.exit('torch must not be in the loadgen image' if importlib.util.find_spec('torch') else 0)" \
    && useradd --uid 10001 --create-home --home-dir /home/vskipper vskipper

USER 10001:10001
WORKDIR /home/vskipper
ENTRYPOINT ["vskipper-loadgen"]
CMD ["--help"]
