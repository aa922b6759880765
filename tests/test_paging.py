"""Host page writes (memory/paging.py): the pages hold exactly the rows written, bit for bit,
for every pool dtype, including FP8 pools, which a CPU backend writes as uint8 bytes
(``host_pool.byte_view``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.memory.host_pool import byte_view, empty_pool, from_byte_view
from lsparse_jax.memory.paging import CompletedPages, page_out

P, D = 4, 8


def expected(pool, rows, pages, count):
    want = np.asarray(pool).copy()
    for j in range(count):
        want[pages[j] * P:(pages[j] + 1) * P] = np.asarray(rows[j * P:(j + 1) * P])
    return want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_page_out_writes_the_rows_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    pool = empty_pool(6, P, D, dtype)
    rows = jnp.asarray(rng.normal(size=(3 * P + 2, D)), jnp.float32)
    pages = jnp.asarray([5, 0, 3], jnp.int32)
    out, tail = jax.jit(page_out, static_argnums=(3, 4))((pool,), (rows.astype(dtype),),
                                                        pages, 3, P)
    want = expected(pool, rows.astype(dtype), [5, 0, 3], 3)
    np.testing.assert_array_equal(np.asarray(out[0]).view(np.uint8), want.view(np.uint8))
    assert out[0].dtype == dtype
    np.testing.assert_array_equal(np.asarray(tail[0][:2], np.float32),
                                  np.asarray(rows[3 * P:], dtype).astype(np.float32))
    assert np.isnan(np.asarray(tail[0][2:], np.float32)).all()


def test_write_tails_of_an_fp8_pool_bit_for_bit():
    rng = np.random.default_rng(1)
    pool = empty_pool(4, P, D, jnp.float8_e4m3fn)
    tails = jnp.asarray(rng.normal(size=(3, P, D)), jnp.float8_e4m3fn)
    done = CompletedPages(slots=jnp.asarray([2, 0], jnp.int32),
                          dest=jnp.asarray([1, 3], jnp.int32),
                          first=jnp.zeros((2,), jnp.int32), num_slots=3)
    out = jax.jit(lambda p, t: done.write_tails(p, t))(pool, tails)
    want = np.asarray(pool).copy()
    want[1 * P:2 * P], want[3 * P:4 * P] = np.asarray(tails[2]), np.asarray(tails[0])
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), want.view(np.uint8))


def test_byte_view_round_trip_leaves_other_dtypes_alone():
    pool = (jnp.zeros((8, D), jnp.float8_e4m3fn), jnp.zeros((8, 1), jnp.float32))
    rows = (jnp.ones((4, D), jnp.float32), jnp.ones((4, 1), jnp.float32))
    viewed, written = byte_view(pool, rows)
    assert [x.dtype for x in viewed] == ([jnp.uint8, jnp.float32] if
                                         jax.default_backend() == "cpu" else
                                         [jnp.float8_e4m3fn, jnp.float32])
    back = from_byte_view(viewed, pool)
    assert [x.dtype for x in back] == [jnp.float8_e4m3fn, jnp.float32]
    pool = (jnp.asarray(np.random.default_rng(2).normal(size=(8, D)), jnp.float8_e4m3fn),
            pool[1])
    back = from_byte_view(byte_view(pool, rows)[0], pool)  # the view loses no bit
    np.testing.assert_array_equal(np.asarray(back[0]).view(np.uint8),
                                  np.asarray(pool[0]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(written[0]).view(np.uint8),
                                  np.asarray(rows[0].astype(jnp.float8_e4m3fn)).view(np.uint8))
