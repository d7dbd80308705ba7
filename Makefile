# Two commands do all set-up on a fresh machine: `make run` (all five stages) and `make test`.
# `make bench` regenerates every benchmark in results/ (stages, INT8 recipes, Ray Serve, the local Ray
# cluster's loss, cache and autoscaling runs, soak) and prints the performance goals against what it
# measured. `make test-fast` is the unit and integration tiers without the slow tests (no Ray, no
# OpenVINO); `make lint` is ruff and mypy.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
# Tests and benchmarks also cover the optional backends: Ray Serve and OpenVINO.
EXTRAS_STAMP := $(VENV)/.requirements-extras-installed
# `make run` tries OpenVINO + NNCF too (stage 2 measures them; --backend auto serves the fastest) and
# carries on with onnxruntime alone where they have no wheel (README: the engine that serves).
OPENVINO_STAMP := $(VENV)/.requirements-openvino-tried
DEV_STAMP := $(VENV)/.requirements-dev-installed
# The page's browser tests drive Debian's Chromium through Playwright (never Playwright's own download).
CHROMIUM := /usr/bin/chromium

.PHONY: run test test-fast lint bench clean

# requirements*.txt install this checkout as the mnv3 package (editable) with extras; pyproject.toml
# holds the dependencies themselves.
$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "mnv3 needs Python 3.11+ (asyncio.timeout); set PYTHON=python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(EXTRAS_STAMP): $(STAMP) requirements-ray.txt requirements-openvino.txt pyproject.toml
	$(PY) -m pip install -q -r requirements-ray.txt -r requirements-openvino.txt
	touch $@

$(OPENVINO_STAMP): $(STAMP) requirements-openvino.txt
	$(PY) -m pip install -q -r requirements-openvino.txt || echo "openvino/nncf not installable here: onnxruntime serves"
	touch $@

run: $(OPENVINO_STAMP)
	$(PY) baseline_export_quantize.py
	$(PY) static_quantization.py
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py

$(DEV_STAMP): $(STAMP) requirements-dev.txt pyproject.toml
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(CHROMIUM):
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

test: $(EXTRAS_STAMP) $(CHROMIUM)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "(unit or integration) and not slow"

# ruff: every Python file in the repo (not .venv, nor what .gitignore lists); mypy: mnv3/ (pyproject.toml).
lint: $(DEV_STAMP)
	$(PY) -m ruff check
	$(PY) -m ruff format --check
	$(PY) -m mypy

bench: $(EXTRAS_STAMP)
	$(PY) baseline_export_quantize.py --transformer-control
	$(PY) static_quantization.py --compare-recipes all
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py --phone-photos 64
	$(PY) -m mnv3.ray_serve --bench
	$(PY) -m mnv3.ray_cluster --bench-loss --bench-cache --bench-autoscale
	$(PY) -m mnv3.soak
	$(PY) -m mnv3.goals

clean:
	rm -rf artifacts calibration_images/generated_[0-9][0-9][0-9][0-9]*.jpg
