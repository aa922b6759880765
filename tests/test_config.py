"""Every config validation error names the field and what is allowed."""

import dataclasses

import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, IndexerConfig, ModelConfig, SamplingConfig
from lsparse_jax.model import preset

BAD = [
    (lambda: ModelConfig(layer_pattern=("swa", "mla")), "layer_pattern", "unknown layer kind"),
    (lambda: ModelConfig(layer_pattern=()), "layer_pattern", "at least one"),
    (lambda: ModelConfig(hidden=0), "hidden", "positive"),
    (lambda: ModelConfig(num_heads=-2), "num_heads", "positive"),
    (lambda: ModelConfig(rope_dim=7), "rope_dim", "even"),
    (lambda: ModelConfig(rope_dim=128, head_dim=64), "rope_dim", "head_dim"),
    (lambda: ModelConfig(max_len=1000), "max_len", "multiple of hca_ratio"),
    (lambda: ModelConfig(csa_ratio=3, max_len=256), "max_len", "multiple of csa_ratio"),
    (lambda: ModelConfig(rope_theta=0.0), "rope_theta", "> 0"),
    (lambda: ModelConfig(indexer={"top_k": 4}), "indexer", "IndexerConfig"),
    (lambda: IndexerConfig(head_dim=96, fp8_block=64), "fp8_block", "divide head_dim=96"),
    (lambda: IndexerConfig(top_k=0), "top_k", "positive"),
    (lambda: IndexerConfig(num_heads=2.5), "num_heads", "positive int"),
    (lambda: CacheConfig(num_slots=0), "num_slots", "positive"),
    (lambda: CacheConfig(hot_cache_rows=0), "hot_cache_rows", "positive"),
    (lambda: SamplingConfig(temperature=-1.0), "temperature", ">= 0"),
    (lambda: EngineConfig(method="magic"), "method", "allowed methods"),
    (lambda: EngineConfig(cache=CacheConfig(hot_cache_rows=8)), "hot_cache_rows",
     "must be >= indexer.top_k=16"),
    (lambda: preset("v4_flash", swa_window=0), "swa_window", "positive"),
]


@pytest.mark.parametrize("make,field,allowed", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_value_names_field_and_rule(make, field, allowed):
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    assert field in msg and allowed in msg


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'v5'.*tiny"):
        preset("v5")


def test_configs_are_frozen_and_hashable():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 3
    assert hash(cfg) == hash(ModelConfig())
    assert ModelConfig(layer_pattern=["swa", "csa"]).layer_pattern == ("swa", "csa")


def test_v4_flash_preset_matches_public_shapes():
    cfg = preset("v4_flash")
    assert cfg.num_layers == 43
    assert (cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.swa_window) == (4096, 64, 512, 128)
    assert (cfg.csa_ratio, cfg.hca_ratio) == (4, 128)
    assert (cfg.indexer.num_heads, cfg.indexer.head_dim, cfg.indexer.top_k) == (64, 128, 512)
    assert cfg.indexer.key_bytes == 132
    assert set(cfg.layer_pattern) == {"swa", "csa", "hca"}


def test_dsa_leader_groups():
    cfg = preset("tiny", layer_pattern=("dsa",) * 5 + ("swa", "dsa"), dsa_share_group=2)
    assert [cfg.dsa_leader(i) for i in (0, 1, 2, 3, 4, 6)] == [0, 0, 2, 2, 4, 4]
