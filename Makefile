# Two commands do all set-up on a fresh machine: `make run` (all five stages) and `make test`.
# `make bench` regenerates every benchmark in results/ (stages, INT8 recipes, Ray Serve, soak) and
# prints the performance goals against what it measured.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
# Tests and benchmarks also cover the optional backends: Ray Serve and OpenVINO.
EXTRAS_STAMP := $(VENV)/.requirements-extras-installed

.PHONY: run test bench clean

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "mnv3 needs Python 3.11+ (asyncio.timeout); set PYTHON=python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(EXTRAS_STAMP): $(STAMP) requirements-ray.txt requirements-openvino.txt
	$(PY) -m pip install -q -r requirements-ray.txt -r requirements-openvino.txt
	touch $@

run: $(STAMP)
	$(PY) baseline_export_quantize.py
	$(PY) static_quantization.py
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py

test: $(EXTRAS_STAMP)
	$(PY) -m pytest -q

bench: $(EXTRAS_STAMP)
	$(PY) baseline_export_quantize.py --transformer-control
	$(PY) static_quantization.py --compare-recipes all
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py
	$(PY) -m mnv3.ray_serve --bench
	$(PY) -m mnv3.soak
	$(PY) -m mnv3.goals

clean:
	rm -rf artifacts calibration_images/generated_*
