# Two commands on a fresh machine:
#   make demo   runs the main job (creates .venv on first use)
#   make test   runs the test suite (creates .venv on first use)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp

.PHONY: demo test test-fast bench clean-venv

$(STAMP): pyproject.toml requirements/ci.txt requirements/no-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/ci.txt
	$(PY) -m pip install -q --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stratarl demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_advantages.py

clean-venv:
	rm -rf $(VENV)
