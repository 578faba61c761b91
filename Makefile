# vSkipper verbs. `make install` builds .venv with the CPU torch 2.13.0 the machines carry (never a CUDA torch).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo
LOADGEN_DEMO_OUT ?= out/loadgen-demo
SGLANG_SPEC ?= sglang==0.5.21
SGLANG_CONSTRAINTS := vskipper/sglang/constraints-cpu.txt
SGLANG_REQUIREMENTS := vskipper/sglang/requirements-cpu.txt

.PHONY: install test demo loadgen-demo lint crd clean help

help:
	@echo "make install  create $(VENV) with the CPU torch, the project (runtime, loadgen, operator, dev extras) and SGLang 0.5.21 for CPU"
	@echo "make demo     the main job on an embedded default: tiny FlexiDepth checkpoint, routes, thresholds, switch"
	@echo "make loadgen-demo  a small matched-work A/B run against two local stand-in servers: report and plots"
	@echo "make test     the test suite"
	@echo "make lint     ruff over the code and tests"
	@echo "make crd      regenerate manifests/crd.yaml from the operator's schema"

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

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/vskipper demo --out $(DEMO_OUT)

loadgen-demo: install
	$(VENV)/bin/vskipper-loadgen demo --out $(LOADGEN_DEMO_OUT)

lint: install
	$(VENV)/bin/ruff check vskipper loadgen operator tests benchmarks

crd: install
	$(VENV)/bin/vskipper-operator crd > manifests/crd.yaml

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
