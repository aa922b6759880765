"""FP8 e4m3 storage of indexer keys: round-trip error bound and layout."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lsparse_jax.quant import dequantize_index_keys, quantize_index_keys


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3), block=st.sampled_from([16, 32, 64]))
def test_round_trip_error_bound(seed, scale, block):
    keys = np.random.default_rng(seed).standard_t(3, size=(7, 64)).astype(np.float32) * scale
    values, scales = quantize_index_keys(jnp.asarray(keys), block)
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (7, 64 // block)
    back = np.asarray(dequantize_index_keys(values, scales))
    s = np.repeat(np.asarray(scales), block, axis=-1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormal spacing 2^-9 in scaled units.
    bound = 2.0**-4 * np.abs(keys) + 2.0**-9 * s
    assert np.all(np.abs(back - keys) <= bound * (1 + 1e-6))
    # the largest magnitude of every block is represented to within its relative bound
    assert np.all(np.abs(np.asarray(values, np.float32)) <= 448.0)


def test_zero_block_and_132_byte_key():
    keys = np.zeros((2, 128), np.float32)
    keys[1] = np.linspace(-3, 3, 128)
    values, scales = quantize_index_keys(jnp.asarray(keys))
    assert values.nbytes // 2 + scales.nbytes // 2 == 132
    back = np.asarray(dequantize_index_keys(values, scales))
    assert np.all(back[0] == 0.0) and float(scales[0, 0]) == 1.0
    # block maxima map to +-448 exactly, so they come back up to the scale's rounding
    np.testing.assert_allclose(back[1, [0, -1]], [-3.0, 3.0], rtol=1e-6)


def test_block_must_divide():
    with pytest.raises(ValueError, match="block=48 must divide the key dim 64"):
        quantize_index_keys(jnp.ones((2, 64)), 48)
