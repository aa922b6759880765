"""``lsparse_jax.kernels``: the engine's implementation -> what each kernel op runs. Every
mapped name is one its op accepts; the families run end to end where the CPU can run them."""

import importlib

import numpy as np
import pytest

from lsparse_jax import kernels
from lsparse_jax.config import EngineConfig
from tests.helpers import model_and_tokens, tiny
from tests.test_hierarchy import engines


@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("implementation", kernels.ENGINE_IMPLEMENTATIONS)
def test_every_mapped_name_is_one_its_op_accepts(op, implementation):
    module, name = kernels.ACCEPTS[op]
    got = kernels.for_op(op, implementation)
    assert got is None if implementation is None else got in getattr(
        importlib.import_module(module), name)
    if implementation in (None, "xla"):
        assert got == implementation


def test_families_differ_from_triton_only_where_named():
    assert kernels.for_op("topk", "triton") == "triton_fused"
    assert kernels.for_op("pq_topc", "jax_triton") == "jax_triton"
    assert kernels.for_op("sparse_attention", "mosaic") == "mosaic"
    for family, special in kernels.FAMILIES.items():
        for op in set(kernels.OPS) - set(special):
            assert kernels.for_op(op, family) == "triton"


def test_own_names_pass_through_and_unknown_names_raise():
    """An op's own name reaches the op; a name neither the engine's nor the op's raises (no
    layer falls back to XLA for it); the engine takes its five only."""
    assert kernels.for_op("hot_resolve", "triton_copy") == "triton_copy"
    with pytest.raises(ValueError, match="'cuda' is unknown"):
        kernels.for_op("index_logits", "cuda")
    with pytest.raises(ValueError, match="'triton_fused' is unknown"):
        kernels.for_op("candidate_topk", "triton_fused")
    with pytest.raises(ValueError, match="unknown op"):
        kernels.for_op("softmax", "xla")
    with pytest.raises(ValueError, match="implementation"):
        EngineConfig(model=tiny(max_len=64), implementation="triton_fused")


# slow tier (session 49): 30 s; the family map's other tests stay
@pytest.mark.slow
def test_jax_triton_family_runs_hisparse_as_triton_on_cpu():
    """HiSparse calls no jax-triton kernel: its "jax_triton" engine runs the Triton kernels
    (interpret mode here) and equals the "triton" engine bit for bit (before, hot_resolve
    rejected the name at the first step)."""
    cfg = tiny(max_len=256)
    params, prompt = model_and_tokens(cfg, 40, seed=5)
    _, family = engines(cfg, params, 16, slots=1, implementation="jax_triton")
    _, triton = engines(cfg, params, 16, slots=1, implementation="triton")
    for e in (family, triton):
        e.admit(prompt, max_new_tokens=6)
    for _ in range(3):
        a, b = family.step(), triton.step()
        np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
        np.testing.assert_array_equal(np.asarray(a.selected), np.asarray(b.selected))


@pytest.mark.gpu
def test_mosaic_family_runs_hisparse_on_gpu():
    """The "mosaic" engine: CSA decode attention by the Mosaic GPU kernel (bf16 rows of
    D = 128: its shapes), the other ops Triton; its logits agree with the "triton" engine's
    where selections agree."""
    cfg = tiny(max_len=512, kv_dtype="bf16", attention_precision="bf16", head_dim=128)
    params, prompt = model_and_tokens(cfg, 90, seed=9)
    _, mosaic = engines(cfg, params, 16, slots=2, implementation="mosaic")
    _, triton = engines(cfg, params, 16, slots=2, implementation="triton")
    for e in (mosaic, triton):
        e.admit(prompt, max_new_tokens=20)
    agree = 0
    for _ in range(12):
        fed = triton.next_token.copy()
        a, b = mosaic.step(fed), triton.step(fed)
        if np.array_equal(np.asarray(a.selected), np.asarray(b.selected)):
            agree += 1
            np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits),
                                       rtol=2e-2, atol=2e-2)
    assert agree >= 6
