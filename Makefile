# Two commands on a fresh machine:
#   make demo   runs the main job (creates .venv on first use)
#   make test   runs the lint and type checks, then the test suite (creates .venv on first use)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp
VENV_VERL ?= .venv-verl
PY_VERL   := $(VENV_VERL)/bin/python

.PHONY: demo lint test test-fast test-verl phantomwiki bench bench-synth bench-trl evidence tables clean-venv

$(STAMP): pyproject.toml requirements/ci.txt requirements/no-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/ci.txt
	$(PY) -m pip install -q --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stratarl demo

# veRL plugins run in their own environment (verl 0.9.1 needs transformers < 5.11); see docs/verl.md.
$(VENV_VERL)/.stamp: pyproject.toml requirements/verl.txt
	test -x $(PY_VERL) || $(PYTHON) -m venv $(VENV_VERL)
	$(PY_VERL) -m pip install -q --upgrade pip
	$(PY_VERL) -m pip install -q --no-compile --no-deps -r requirements/verl.txt
	$(PY_VERL) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VENV_VERL)/.stamp

# Lint, format check and type check (settings in pyproject.toml); `make test` runs them first.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# PhantomWiki's generator (docs/benchmarks.md) needs Python >= 3.12 and SWI-Prolog: its own environment, built
# with the first Python >= 3.12 found (PATH, then pyenv's versions; PYTHON312=... to choose), and Debian's
# swi-prolog-nox when `swipl` is missing (apt-get: root, as CI runs).
VENV_PHANTOM ?= .venv-phantom
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3 python3.13 $$HOME/.pyenv/versions/3.13*/bin/python3; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
$(VENV_PHANTOM)/.stamp: requirements/phantomwiki.txt
	@test -n "$(PYTHON312)" || { echo "PhantomWiki needs Python >= 3.12: none found on PATH or in pyenv. Fix: install one and run make PYTHON312=/path/to/python3.12 phantomwiki"; exit 2; }
	@command -v swipl >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends swi-prolog-nox; } || { echo "PhantomWiki needs SWI-Prolog. Fix: apt-get install swi-prolog-nox (as root)"; exit 2; }
	test -x $(VENV_PHANTOM)/bin/python || $(PYTHON312) -m venv $(VENV_PHANTOM)
	$(VENV_PHANTOM)/bin/python -m pip install -q --upgrade pip
	$(VENV_PHANTOM)/bin/python -m pip install -q --no-deps -r requirements/phantomwiki.txt
	$(VENV_PHANTOM)/bin/phantom-wiki-generate --help >/dev/null
	touch $(VENV_PHANTOM)/.stamp

phantomwiki: $(VENV_PHANTOM)/.stamp

test: lint $(STAMP) $(VENV_VERL)/.stamp $(VENV_PHANTOM)/.stamp
	$(PY) -m pytest -n 2 --dist loadgroup -q
	$(PY_VERL) -m pytest tests/verl -q -p no:cacheprovider

test-verl: $(VENV_VERL)/.stamp
	$(PY_VERL) -m pytest tests/verl -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_advantages.py
	$(PY) benchmarks/bench_retrieval.py
	$(PY) benchmarks/bench_generation.py --threads 2
	$(PY) benchmarks/bench_wordlevel.py
	$(PY) benchmarks/bench_train.py --threads 2

# TRL's GRPOTrainer vs stratarl on the same model, prompts, group size and batch (docs/training.md).
VENV_TRL ?= .venv-trl
$(VENV_TRL)/.stamp: pyproject.toml requirements/ci.txt requirements/no-deps.txt requirements/trl.txt
	test -x $(VENV_TRL)/bin/python || $(PYTHON) -m venv $(VENV_TRL)
	$(VENV_TRL)/bin/python -m pip install -q --upgrade pip
	$(VENV_TRL)/bin/python -m pip install -q -r requirements/ci.txt -r requirements/trl.txt
	$(VENV_TRL)/bin/python -m pip install -q --no-deps -r requirements/no-deps.txt
	$(VENV_TRL)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VENV_TRL)/.stamp

bench-trl: $(VENV_TRL)/.stamp
	$(VENV_TRL)/bin/python benchmarks/bench_train.py --trl-only

bench-synth: $(STAMP)
	$(PY) benchmarks/synth_retrievability.py

# The v3 evidence sweeps of docs/results.md (each file states its cost: ~2 h and ~5 h on 2 cores); rerun to
# resume (summarised runs are skipped). `make tables` regenerates every table and figure from the summaries.
evidence: $(STAMP)
	$(PY) benchmarks/evidence/run.py lab_stratified_twohop --jobs 2 --out runs/evidence
	$(PY) benchmarks/evidence/run.py lab_sorl_reuse --jobs 2 --out runs/evidence

tables: $(STAMP)
	$(PY) benchmarks/evidence/tables.py
	$(PY) benchmarks/evidence/headline.py

clean-venv:
	rm -rf $(VENV) $(VENV_VERL) $(VENV_TRL) $(VENV_PHANTOM)
