# Two commands do all set-up on a fresh machine: `make run` (all five stages) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
# The tests also cover the optional Ray Serve deployment, so they install its extra.
TEST_STAMP := $(VENV)/.requirements-ray-installed

.PHONY: run test bench clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(TEST_STAMP): $(STAMP) requirements-ray.txt
	$(PY) -m pip install -q -r requirements-ray.txt
	touch $@

run: $(STAMP)
	$(PY) baseline_export_quantize.py
	$(PY) static_quantization.py
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py

test: $(TEST_STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf artifacts calibration_images/generated_*
