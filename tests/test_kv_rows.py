"""KV rows stored as DeepSeek-V4 stores them (quant.kv_rows, ModelConfig.kv_dtype): the FP8
round trip within the bound of its format, NaN poison kept, bytes per row, and decode logits
of a tiny model with FP8 / bf16 rows against f32 rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, ModelConfig
from lsparse_jax.quant import FP8Rows, KVRowFormat
from lsparse_jax.quant.kv_rows import FP8_BLOCK
from lsparse_jax.serving.engine import Engine
from tests.helpers import model_and_tokens, tiny


def _rows(num, dim, seed=0):
    """Rows whose blocks span magnitudes 1e-4 .. 1e3 (a scale per block matters), one all-zero
    row, one row with a zero block and one NaN row (never written)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num, dim)).astype(np.float32)
    x *= 10.0 ** rng.uniform(-4, 3, (num, 1))
    x *= np.repeat(10.0 ** rng.uniform(-2, 2, (num, -(-dim // FP8_BLOCK))), FP8_BLOCK, 1)[:, :dim]
    x[1] = 0.0
    x[2, :FP8_BLOCK] = 0.0
    x[3] = np.nan
    return x


@pytest.mark.parametrize("dim,rope,nbytes", [(512, 64, 583), (64, 16, 81), (32, 16, 49)])
def test_fp8_rows_round_trip_within_the_format_bound(dim, rope, nbytes):
    """Per value: |x - x'| <= 2^-4 |x| + 2^-10 s (non-RoPE, s its block's scale, a power of two
    with max|x| / 448 <= s < 2 max|x| / 448), |y - y'| <= 2^-8 |y| (RoPE part, bf16)."""
    fmt = KVRowFormat("fp8_v4", dim, rope)
    x = _rows(40, dim)
    stored = fmt.encode(jnp.asarray(x))
    got = np.asarray(fmt.decode(stored))
    # bytes: V4-Flash 448 FP8 + 7 e8m0 scales + 64 bf16 = 583 (V4's 584 less its pad byte)
    assert fmt.row_bytes == nbytes == sum(a.nbytes for a in stored) // x.shape[0]
    n = dim - rope
    ok = ~np.isnan(x).any(-1)
    scale = np.asarray(stored.scales.astype(jnp.float32))  # [rows, nb]
    pad = np.zeros((x.shape[0], scale.shape[1] * FP8_BLOCK - n), np.float32)
    amax = np.abs(np.concatenate([x[:, :n], pad], 1)).reshape(x.shape[0], -1, FP8_BLOCK).max(-1)
    assert np.all(np.log2(scale[ok]) == np.round(np.log2(scale[ok])))  # powers of two
    assert np.all(np.where(amax[ok] > 0, scale[ok] >= amax[ok] / 448, scale[ok] == 1.0))
    assert np.all(np.where(amax[ok] > 0, scale[ok] < 2 * amax[ok] / 448, True))
    s = np.repeat(scale, FP8_BLOCK, 1)[:, :n]
    err = np.abs(got[ok, :n] - x[ok, :n])
    assert np.all(err <= 2.0 ** -4 * np.abs(x[ok, :n]) + 2.0 ** -10 * s[ok])
    assert np.all(np.abs(got[ok, n:] - x[ok, n:]) <= 2.0 ** -8 * np.abs(x[ok, n:]))
    np.testing.assert_array_equal(got[1], 0.0)  # zero rows and blocks come back exactly
    np.testing.assert_array_equal(got[2, :FP8_BLOCK], 0.0)
    assert np.isnan(got[3]).all() and all(np.isnan(np.asarray(a[3], np.float32)).all()
                                          for a in stored)
    # the empty (never written) rows are NaN in every array and decode to NaN
    empty = fmt.empty(2)
    assert isinstance(empty, FP8Rows) and np.isnan(np.asarray(fmt.decode(empty))).all()


def test_fp8_rows_are_closer_than_the_bound_on_average_and_bf16_closer_still():
    """Relative row error at V4 shapes: FP8 rows (e4m3 + power-of-two scales) within 6%,
    bf16 rows within 0.4% (each value within 2^-8), f32 rows exact."""
    x = jnp.asarray(_rows(64, 512, seed=1)[4:])  # finite rows with a nonzero block each
    err = {}
    for kind in ("f32", "bf16", "fp8_v4"):
        fmt = KVRowFormat(kind, 512, 64)
        d = fmt.decode(fmt.encode(x)) - x
        err[kind] = float(jnp.max(jnp.linalg.norm(d, axis=-1) / jnp.linalg.norm(x, axis=-1)))
    assert err["f32"] == 0.0 and err["bf16"] <= 2.0 ** -8 < err["fp8_v4"] <= 0.06


def test_kv_dtype_is_validated():
    with pytest.raises(ValueError, match=r"ModelConfig.kv_dtype='fp16' is invalid: allowed"):
        ModelConfig(kv_dtype="fp16")
    with pytest.raises(ValueError, match=r"ModelConfig.kv_dtype='fp8_v4' is invalid: .*rope_dim"):
        ModelConfig(kv_dtype="fp8_v4", rope_dim=0)
    assert ModelConfig().kv_dtype == "f32"  # the default keeps f32 rows


def test_decode_logits_with_fp8_and_bf16_rows_within_tolerance_of_f32():
    """SWA, CSA, then HCA: the CSA layer's input does not depend on kv_dtype, so every kv_dtype
    selects the same rows, and the logits differ only by the stored CSA and HCA rows.
    Teacher-forced decode of 30 tokens after a 150-token prompt: max |logit - f32 logit| <= 0.1
    for FP8 rows (measured 0.046; the logits' std is ~1) and <= 0.01 for bf16 rows (measured
    0.0038); greedy tokens equal."""
    cfg = tiny(max_len=512, layer_pattern=("swa", "csa", "hca"))
    params, prompt = model_and_tokens(cfg, 150, seed=3)
    feed = np.random.default_rng(0).integers(0, 256, 30).astype(np.int32)
    logits, selected = {}, {}
    for kind in ("f32", "bf16", "fp8_v4"):
        model = dataclasses.replace(cfg, kv_dtype=kind)
        engine = Engine(EngineConfig(model=model, cache=CacheConfig(prefill_chunk=32)), params)
        engine.admit(prompt, max_new_tokens=len(feed))
        outs = [engine.step(np.array([t], np.int32)) for t in feed]
        logits[kind] = np.stack([np.asarray(o.logits)[0] for o in outs])
        selected[kind] = np.stack([np.asarray(o.selected)[0] for o in outs])
    for kind, tol in (("fp8_v4", 0.1), ("bf16", 0.01)):
        np.testing.assert_array_equal(selected[kind], selected["f32"])
        diff = np.abs(logits[kind] - logits["f32"]).max()
        assert 0 < diff <= tol, (kind, diff)
        np.testing.assert_array_equal(logits[kind].argmax(-1), logits["f32"].argmax(-1))


def test_resident_cache_stores_the_encoded_rows():
    """The prefilled resident cache holds exactly encode(compressor rows): rows of an f32
    prefill, encoded, equal the FP8 prefill's stored arrays byte for byte (the layers before
    the first CSA layer do not depend on kv_dtype)."""
    from lsparse_jax.serving.steps import prefill

    cfg = tiny(max_len=512)  # the shapes of the leansparse test's: its compiles are reused
    params, prompt = model_and_tokens(cfg, 90, seed=5)
    f32, _ = prefill(params, cfg, prompt, 32)
    fp8_cfg = dataclasses.replace(cfg, kv_dtype="fp8_v4")
    fp8, _ = prefill(params, fp8_cfg, prompt, 32)
    want = KVRowFormat.of(fp8_cfg).encode(f32[1].kv.entries)
    got = fp8[1].kv.entries
    assert isinstance(got, FP8Rows)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_leansparse_with_fp8_rows_equals_resident_with_fp8_rows():
    """Identity 6 at kv_dtype="fp8_v4" on both sides: with C >= every eligible history and no
    miss filter, leansparse (FP8 rows in host pages behind the hot cache, keys paged too)
    emits resident's logits bit for bit, and every row is on the GPU or in a host page."""
    from lsparse_jax.config import LeanSparseConfig
    from lsparse_jax.memory.invariant import hierarchy_violations
    from lsparse_jax.methods.leansparse import calibrate_codebooks

    cfg = tiny(max_len=512, kv_dtype="fp8_v4")
    params, prompt = model_and_tokens(cfg, 140, seed=11)
    books = calibrate_codebooks(params, cfg, prompt, iters=2)
    engines = [Engine(EngineConfig(
        model=cfg, method=method, leansparse=LeanSparseConfig(128, None, 128),
        cache=CacheConfig(num_slots=1, prefill_chunk=32, page_size=8, hot_cache_rows=rows)),
        params, books) for method, rows in (("resident", None), ("leansparse", 16))]
    for engine in engines:
        engine.admit(prompt, max_new_tokens=40)
    resident, lean = engines
    for _ in range(36):  # 9 compressed rows: a page of 8 rows is written back on the way
        fed = resident.next_token.copy()  # both engines decode the same context
        want, got = resident.step(), lean.step(tokens=fed)
        np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    assert hierarchy_violations(lean.config, lean.state, resident.state.caches,
                                resident.active) == []
    assert lean.metrics()["selection"]["host_rows"] > 0


def test_attention_precision_is_validated():
    with pytest.raises(ValueError, match=r"ModelConfig.attention_precision='fp16' is invalid"):
        ModelConfig(attention_precision="fp16")
    assert ModelConfig().attention_precision == "f32"  # the default keeps the kernel's f32 path


@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8_v4"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_kernel_rows_hand_the_kernel_its_format(kind, precision):
    """model.blocks.kernel_rows: at "f32" the kernel gets f32 rows (f32 tables as stored, the
    selected rows of others decoded); at "bf16" bf16 and FP8 tables as stored (the same
    arrays: read in place), f32 tables' selected rows rounded to bf16. Either way the rows the
    slots name, in slot order, are the decoded selected rows (in the kernel's dtype)."""
    from lsparse_jax.model.blocks import kernel_rows
    from lsparse_jax.model.store import RowView

    fmt = KVRowFormat(kind, 128, 64)
    stored = jax.tree.map(lambda a: a[None], fmt.encode(jnp.asarray(_rows(20, 128)[4:])))
    slots = jnp.asarray([[3, -1, 7, 0, 3]], jnp.int32)
    view = RowView(stored, slots, jnp.zeros((1, 3), jnp.int32))
    got = kernel_rows(fmt, view, precision)
    in_place = (precision == "f32") == (kind == "f32") or (precision, kind) == ("bf16", "bf16")
    leaves = jax.tree.leaves(got.table)
    if in_place:
        assert all(a is b for a, b in zip(leaves, jax.tree.leaves(stored)))
        np.testing.assert_array_equal(got.slots, slots)
    else:
        assert got.table.shape == (1, 5, 128)
        assert got.table.dtype == (jnp.float32 if precision == "f32" else jnp.bfloat16)
        np.testing.assert_array_equal(got.slots, [[0, -1, 2, 3, 4]])
    if kind == "fp8_v4" and precision == "bf16":
        assert isinstance(got.table, tuple) and not isinstance(got.table, FP8Rows)
    dtype = jnp.float32 if precision == "f32" else jnp.bfloat16
    table = got.table if not isinstance(got.table, tuple) else FP8Rows(*got.table)
    rows = fmt.decode(table)[0] if kind == "fp8_v4" and in_place else got.table[0]
    picked = rows[jnp.maximum(got.slots[0], 0)].astype(jnp.float32)
    want = fmt.decode(jax.tree.map(lambda a: a[0], stored))[jnp.maximum(slots[0], 0)]
    valid = np.asarray(slots[0]) >= 0
    np.testing.assert_array_equal(np.asarray(picked)[valid], np.asarray(
        want.astype(dtype).astype(jnp.float32))[valid])
    with pytest.raises(ValueError, match="attention_precision='fp16'"):
        kernel_rows(fmt, view, "fp16")
