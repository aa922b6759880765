"""The quickstart CLI end to end, shortened through gin overrides."""

import json

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
    (row,) = results["methods"]
    assert row["method"] == "resident" and row["decode_tokens"] == 5
    assert len(row["generated"]) >= 6  # first token from prefill + 5 decode steps (bytes)
    cfg = preset("tiny", max_len=results["model"]["max_len"])
    assert results["model"]["max_len"] == 640  # 606 tokens rounded up to the HCA stride
    assert row["device_bytes_per_request"] == expected_slot_bytes(cfg)
    assert "quickstart.decode_steps = 5" in (out / "config.gin").read_text()
    assert (out / "quickstart.png").stat().st_size > 0


def test_cli_rejects_bad_override(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["run", "configs/quickstart.gin", "decode_steps=3"])
    assert "overrides look like --gin.NAME=VALUE" in capsys.readouterr().err
