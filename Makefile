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

# --dist worksteal: each worker takes a contiguous half of the tests (a module's tests mostly on
# one worker, so their programs are compiled once and reused from the run's compilation cache),
# then steals from the other at the end (session 37, 2 cores: 791 s against 1015-1066 s for
# xdist's default round-robin, which compiles a module's programs in both workers at once)
test: setup
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 --dist worksteal -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -n 2 --dist worksteal -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check lsparse_jax pallas_kernels experiments tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
