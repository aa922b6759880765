# lsparse-jax: `make demo` runs the quickstart on CPU; `make test` runs the test suite without
# the tests marked slow or gpu; `make test-all` runs every test (gpu ones skip without a GPU).
# Both create .venv with a Python >= 3.12 (scripts/find_python.sh picks it) on first use.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-all setup clean lint

$(BIN)/.installed: pyproject.toml
	@PY=$$(scripts/find_python.sh) || exit 1; \
	echo "using $$PY"; \
	$$PY -m venv $(VENV) && \
	$(BIN)/python -m pip install --quiet --upgrade pip && \
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/lsparse run configs/quickstart.gin

test: setup
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check lsparse_jax pallas_kernels experiments tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
