"""The quickstart CLI end to end, shortened through gin overrides."""

import json

import pytest

from experiments.cli import main
from lsparse_jax.model import preset
from tests.test_serving import expected_slot_bytes


def test_quickstart_cli_writes_results(tmp_path, monkeypatch):
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    rc = main(["run", "configs/quickstart.gin", "--gin.quickstart.prompt_tokens=600",
               "--gin.quickstart.decode_steps=5", "--gin.quickstart.prefill_chunk=128",
               "--gin.run.name='qs'"])
    assert rc == 0
    out = tmp_path / "qs"
    results = json.loads((out / "results.json").read_text())
    resident, hisparse = results["methods"]
    assert (resident["method"], hisparse["method"]) == ("resident", "hisparse")
    assert resident["decode_tokens"] == hisparse["decode_tokens"] == 5
    assert hisparse["generated"] == resident["generated"]  # lossless: the same greedy tokens
    cfg = preset("tiny", max_len=results["model"]["max_len"])
    assert results["model"]["max_len"] == 640  # 606 tokens rounded up to the HCA stride
    assert resident["device_bytes_per_request"] == expected_slot_bytes(cfg)
    assert hisparse["device_bytes_per_request"] < resident["device_bytes_per_request"]
    assert resident["host_bytes_per_request"] == 0 < hisparse["host_bytes_per_request"]
    frac = hisparse["selection"]["resolved_fraction"]
    assert sum(frac.values()) == pytest.approx(1.0)
    assert resident["selection"]["resolved_fraction"]["tail_or_resident"] == 1.0
    assert "quickstart.decode_steps = 5" in (out / "config.gin").read_text()
    assert (out / "quickstart.png").stat().st_size > 0


def test_cli_rejects_bad_override(capsys):
    with pytest.raises(SystemExit):
        main(["run", "configs/quickstart.gin", "decode_steps=3"])
    assert "overrides look like --gin.NAME=VALUE" in capsys.readouterr().err
