# Two commands do all set-up on a fresh machine: `make run` (all five stages) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed

.PHONY: run test bench clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

run: $(STAMP)
	$(PY) baseline_export_quantize.py
	$(PY) static_quantization.py
	$(PY) fastapi_serving.py
	$(PY) caching.py
	$(PY) batching_loadtest.py

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf artifacts calibration_images/generated_*
