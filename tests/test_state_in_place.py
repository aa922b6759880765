"""The decode step updates the donated state in place: every state buffer, the host pools
included, is the same buffer after each step (from the engine's first step on), so a step
never holds a second copy of a pool. Session 25 saw a 1M, batch-64 cell on the H200 allocate
a pool-sized host buffer inside jit_decode_step; ``test_gpu_state_in_place`` is this test on
the GPU, where pools live in pinned_host memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.serving.engine import Engine
from tests.helpers import model_and_tokens, tiny


def assert_steps_in_place(method: str, implementation: str):
    cfg = tiny(max_len=512, kv_dtype="f32")
    params, _ = model_and_tokens(cfg, 1, seed=3)
    cache = CacheConfig(num_slots=3, prefill_chunk=32, page_size=8,
                        hot_cache_rows=None if method == "resident" else 16,
                        optional_pages=4 if method == "adaptive" else None)
    eng = Engine(EngineConfig(model=cfg, method=method, implementation=implementation,
                              cache=cache), params)
    kinds = [a.sharding.memory_kind for a in jax.tree.leaves(eng.state)]
    assert method == "resident" or "pinned_host" in kinds  # the pools are in the state
    pointers = lambda: [a.unsafe_buffer_pointer() if a.size else None  # noqa: E731
                        for a in jax.tree.leaves(eng.state)]
    before = pointers()
    eng.warmup()  # the engine's first decode step: an idle one, on the empty state
    assert pointers() == before
    eng.admit(np.arange(70, dtype=np.int32) % 256, max_new_tokens=8)
    before = pointers()
    for _ in range(3):
        eng.step()
        assert pointers() == before
    assert jnp.all(eng.state.lengths[:1] == 70 + 3)


@pytest.mark.parametrize("method", ["resident", "hisparse", "adaptive"])
def test_decode_steps_update_the_state_in_place(method):
    assert_steps_in_place(method, "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["resident", "hisparse", "adaptive"])
def test_gpu_state_in_place(method):
    assert jax.devices()[0].platform == "gpu"
    assert_steps_in_place(method, "triton")
