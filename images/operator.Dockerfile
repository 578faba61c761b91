# The vSkipper operator: the pure-Python core plus kopf/kubernetes; no torch. Non-root, read-only-root friendly.
#   docker build -f images/operator.Dockerfile -t vskipper-operator .
# BASE_IMAGE: any Debian/Ubuntu-like image with python3 (>= 3.10) and its venv module.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vskipper ./vskipper
COPY operator ./operator
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "./[operator]" \
    && python -c "import importlib.util, sys; sys.exit('torch must not be in the operator image' if importlib.util.find_spec('torch') else 0)" \
    && vskipper-operator crd > /dev/null \
    && useradd --uid 10001 --create-home --home-dir /home/vskipper vskipper
COPY manifests/examples /opt/vskipper/examples

USER 10001:10001
WORKDIR /home/vskipper
EXPOSE 8080 9090
ENTRYPOINT ["vskipper-operator"]
CMD ["run"]
