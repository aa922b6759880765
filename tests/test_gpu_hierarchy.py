"""The host tier on a real GPU: pinned_host pools, in-jit copies, hisparse == resident."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.memory import empty_pool, read_host_rows, write_host_page

pytestmark = pytest.mark.gpu


def test_pool_lives_in_pinned_host_and_round_trips():
    assert jax.devices()[0].platform == "gpu"
    pool = empty_pool(64, 16, 128)
    assert pool.sharding.memory_kind == "pinned_host"
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(16, 128)), jnp.float32)
    pool = jax.jit(write_host_page, donate_argnums=0)(pool, 5, rows)
    assert pool.sharding.memory_kind == "pinned_host"
    ids = jnp.asarray([5 * 16 + 3, -1, 5 * 16 + 15], jnp.int32)
    got = np.asarray(jax.jit(read_host_rows)(pool, ids))
    np.testing.assert_array_equal(got[0], np.asarray(rows[3]))
    np.testing.assert_array_equal(got[2], np.asarray(rows[15]))
    assert np.isnan(got[1]).all()
    # under vmap (one call per slot) every slot gets its own rows
    batched = jnp.asarray([[5 * 16, -1], [-1, 5 * 16 + 1]], jnp.int32)
    out = np.asarray(jax.jit(jax.vmap(read_host_rows, in_axes=(None, 0)))(pool, batched))
    np.testing.assert_array_equal(out[0, 0], np.asarray(rows[0]))
    np.testing.assert_array_equal(out[1, 1], np.asarray(rows[1]))


@pytest.mark.parametrize("kv_dtype", ["f32", "fp8_v4"])
def test_hisparse_bit_identical_on_gpu(kv_dtype):
    from tests.test_hierarchy import (
        test_hisparse_bit_identical_to_resident_with_invariant,
        test_hisparse_with_pallas_host_gather_is_bit_identical,
    )

    test_hisparse_bit_identical_to_resident_with_invariant(16, kv_dtype, None)
    test_hisparse_bit_identical_to_resident_with_invariant(16, kv_dtype, 22)  # device pools
    for precision in ("f32", "bf16"):  # zero-copy, for real
        test_hisparse_with_pallas_host_gather_is_bit_identical(kv_dtype, precision)


@pytest.mark.parametrize("coarse", [{}, {"coarse_implementation": "jax_triton"},
                                    {"coarse_implementation": "jax_triton",
                                     "coarse_precision": "fp8"}],
                         ids=["pallas", "jax_triton", "jax_triton_fp8"])
def test_leansparse_kernels_match_xla_on_gpu(coarse):
    """The decode step with the kernels (bf16 tensor-core scores; the coarse pass by the Pallas
    kernel, or the jax-triton one in bf16 or fp8: leansparse_fp8_jt of the scale study) selects
    what the XLA reference (fp8: its fp8 twin) selects up to boundary ties, and its logits
    agree where selections agree."""
    import dataclasses

    from lsparse_jax.config import LeanSparseConfig
    from tests.test_leansparse import kernel_step_against_xla

    lean = LeanSparseConfig(num_candidates=64, miss_filter_offset=1.0, key_cache_rows=96,
                            coarse_precision=coarse.get("coarse_precision", "bf16"))
    kernel_step_against_xla(lean, dataclasses.replace(lean, **coarse), steps=30)


def test_bf16_stored_weights_equal_f32_weights_at_bf16_matmuls_on_gpu():
    """On the GPU a "bf16" matmul rounds its f32 operands to bf16, so storing the weights
    bf16 (``ModelConfig.weight_dtype``) changes no logit: the same engine with the original
    f32 weights gives the same tokens and logits bit for bit."""
    import dataclasses

    from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
    from lsparse_jax.serving.engine import Engine
    from tests.helpers import assert_same_continuation, model_and_tokens, tiny

    cfg = tiny(max_len=128, matmul_precision="bf16")
    params, prompt = model_and_tokens(cfg, 37, seed=3)
    engines = []
    for model in (cfg, dataclasses.replace(cfg, weight_dtype="bf16")):
        engine = Engine(EngineConfig(model=model, method="hisparse",
                                     sampling=SamplingConfig(0.0),
                                     cache=CacheConfig(2, 16, 32, 8)), params)
        engine.admit(prompt)
        engines.append(engine)
    assert_same_continuation(engines[0], engines[1], 6)


@pytest.mark.parametrize("method", ["resident", "hisparse"])
def test_pooled_keys_read_in_place_on_gpu(method):
    """The paged index_scores kernel in the decode step for real (device pools vs keys
    contiguous, implementation="triton"): bit for bit (``tests/test_device_pool.py``)."""
    from tests.test_device_pool import test_paged_index_kernel_reads_pools_in_place_bit_for_bit

    test_paged_index_kernel_reads_pools_in_place_bit_for_bit(method)


def test_pooled_codes_read_in_place_on_gpu():
    """The paged pq_topc kernel in LeanSparse's decode step for real (codes in device pools vs
    in the slot, implementation="triton"): bit for bit (``tests/test_leansparse.py``)."""
    from tests.test_leansparse import test_pooled_codes_are_read_in_place_bit_for_bit_with_kernels

    test_pooled_codes_are_read_in_place_bit_for_bit_with_kernels()
