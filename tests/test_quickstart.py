"""The quickstart CLI end to end, shortened through gin overrides."""

import json

import pytest

from experiments.cli import main
from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.model import preset
from tests.test_serving import expected_slot_bytes


def test_quickstart_cli_writes_results(tmp_path, monkeypatch):
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    rc = main(["run", "configs/quickstart.gin", "--gin.quickstart.prompt_tokens=600",
               "--gin.quickstart.decode_steps=5", "--gin.quickstart.prefill_chunk=128",
               "--gin.quickstart.methods=('hisparse', 'resident', 'leansparse', 'adaptive')",
               "--gin.quickstart.calibration_tokens=1024",  # leansparse's codebooks, not 4K
               "--gin.run.name='qs'"])
    assert rc == 0
    out = tmp_path / "qs"
    results = json.loads((out / "results.json").read_text())
    hisparse, resident, lean, adaptive = results["methods"]  # rows in the order asked for
    assert [r["method"] for r in results["methods"]] == ["hisparse", "resident", "leansparse",
                                                         "adaptive"]
    # resident ran first: a method listed before it still gets a recall, not 'ref'
    assert [line.split()[5] for line in results["table"].splitlines()[2:]] == [
        "1.000", "ref", f"{lean['recall']:.3f}", "1.000"]
    assert resident["decode_tokens"] == hisparse["decode_tokens"] == lean["decode_tokens"] == 5
    for exact in (hisparse, adaptive):  # lossless: the same greedy tokens
        assert exact["generated"] == resident["generated"] and exact["recall"] == 1.0
    assert 0.0 < lean["recall"] <= 1.0
    # 600 tokens = 150 rows: two complete 64-row pages, both lent, so no host copies at all
    assert adaptive["selection"]["host_rows"] == 0 < hisparse["selection"]["host_rows"]
    assert resident["recall"] is None  # the reference
    # (at this 600-token prompt the fixed-size key cache outweighs the keys it replaces; at the
    # quickstart's 8K tokens leansparse keeps the least on the GPU:)
    sizes = {}
    for method in ("resident", "hisparse", "leansparse"):
        cache = CacheConfig(hot_cache_rows=None if method == "resident" else 64, page_size=64)
        engine = EngineConfig(model=preset("tiny"), method=method, cache=cache,
                              leansparse=LeanSparseConfig(64, 1.0, 128))
        sizes[method] = request_bytes(engine, 8192 + 64).gpu_total
    assert sizes["leansparse"] < sizes["hisparse"] < sizes["resident"]
    cfg = preset("tiny", max_len=results["model"]["max_len"])
    assert results["model"]["max_len"] == 640  # 606 tokens rounded up to the HCA stride
    assert resident["device_bytes_per_request"] == expected_slot_bytes(cfg)
    assert hisparse["device_bytes_per_request"] < resident["device_bytes_per_request"]
    assert resident["host_bytes_per_request"] == 0 < hisparse["host_bytes_per_request"]
    frac = hisparse["selection"]["resolved_fraction"]
    assert sum(frac.values()) == pytest.approx(1.0)
    assert resident["selection"]["resolved_fraction"]["tail_or_resident"] == 1.0
    saved = (out / "config.gin").read_text()
    assert "quickstart.decode_steps = 5" in saved
    # the saved config is the one that ran: the fitted max_len, not the preset's 2048
    assert saved.rstrip().endswith("model_preset.max_len = 640")
    assert results["derived_bindings"] == {"model_preset.max_len": 640}
    assert (out / "quickstart.png").stat().st_size > 0


def test_cli_rejects_bad_override(capsys):
    with pytest.raises(SystemExit):
        main(["run", "configs/quickstart.gin", "decode_steps=3"])
    assert "overrides look like --gin.NAME=VALUE" in capsys.readouterr().err
