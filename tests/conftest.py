import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache in a directory of this test session: most of a test's time
# on CPU is XLA compiling (hundreds of small programs per engine test), and the same programs
# are compiled again in every module (the jit caches are dropped after each, below) and in both
# xdist workers. The controller creates the directory before it starts the workers, which
# inherit it through the environment; the controller removes it at exit. A cache hit loads the
# executable XLA compiled before, so results are unchanged (measured: -28% CPU time on
# test_echo + test_device_pool + test_methods in one process). LSPARSE_TEST_JAX_CACHE=0 turns
# it off; an existing JAX_COMPILATION_CACHE_DIR is left alone. JAX writes entries in place, so
# a worker can read one the other is still writing: JAX then warns "Error reading persistent
# compilation cache entry ... truncated stream" and compiles the program itself (harmless).
# XLA's CPU backend at optimization level 0 (where the run is pinned to the CPU and XLA_FLAGS is
# unset): compiling is most of the suite's time and these programs are tiny, so LLVM's
# optimizations cost more than they save (measured: the suite 691 -> 542 s on 2 cores). Every
# test compares two computations of one run, or against a tolerance, so both sides see the same
# flags; `make test-all` and any run with XLA_FLAGS set keep XLA's defaults.
# LSPARSE_TEST_FAST_COMPILE=0 turns it off.
if (os.environ.get("JAX_PLATFORMS") == "cpu" and "XLA_FLAGS" not in os.environ
        and os.environ.get("LSPARSE_TEST_FAST_COMPILE") != "0"):
    os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                               "--xla_llvm_disable_expensive_passes=true")
_CACHE_ENV = "LSPARSE_TEST_JAX_CACHE_DIR"
_made_cache_dir = None
# Only where the run is pinned to the CPU (make test): GPU runs are left as they were.
if (os.environ.get("JAX_PLATFORMS") == "cpu" and os.environ.get("LSPARSE_TEST_JAX_CACHE") != "0"
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
    if _CACHE_ENV not in os.environ:
        _made_cache_dir = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="lsparse-jax-cache-")
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small ones add up
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _made_cache_dir is not None:  # the process that made it: the controller, or -n 0
        shutil.rmtree(_made_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if _backend_ok() else False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _backend_ok() -> bool:
    try:
        jax.devices()
        return True
    except RuntimeError:
        return False


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drops the jit caches after each test module. A pytest worker runs hundreds of tests, and
    every compiled program they leave behind stays in its memory (measured: +2.6 GB over four
    modules); two workers then ran a 2-core CI machine out of memory inside an XLA compile."""
    yield
    jax.clear_caches()
