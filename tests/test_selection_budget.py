"""benchmarks/selection_budget.py: the selection budget from a profile's records, exactly."""

import importlib.util
import pathlib

import pytest

spec = importlib.util.spec_from_file_location(
    "selection_budget", pathlib.Path(__file__).parents[1] / "benchmarks" / "selection_budget.py")
selection_budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(selection_budget)


def _records(lean_method="leansparse_fp8_jt", lean_error=None):
    his = dict(method="hisparse", context=524288, batch=36, step_ms=5.0, error=None,
               by_kind={"pallas:index_scores": 0.5, "pallas:topk": 0.25, "pallas:select": 0.25,
                        "gemm": 2.0, "pallas:hot_resolve": 1.5})
    lean = dict(method=lean_method, context=524288, batch=36, step_ms=4.5, error=lean_error,
                by_kind={"pallas:pq_scores": 0.5, "gemm": 2.0})
    return [his, lean]


def test_budget_is_the_target_step_less_the_shared_work():
    b = selection_budget.budget(_records(), target=0.85)
    assert b["hisparse_selection_ms"] == 1.0  # index scores + top-k + select
    assert b["shared_ms"] == 4.0 and b["shared_fraction"] == 0.8
    assert b["budget_ms"] == pytest.approx(0.85 * 5.0 - 4.0)
    assert b["leansparse_selection_ms"] == pytest.approx(0.5)
    assert b["ratio"] == pytest.approx(0.9)
    assert b["method"] == "leansparse_fp8_jt"


@pytest.mark.parametrize("records", [_records()[:1], _records(lean_error="OOM"),
                                     _records() + _records()[1:]])
def test_missing_failed_or_doubled_records_raise(records):
    with pytest.raises(ValueError, match="selection_budget: need one leansparse"):
        selection_budget.budget(records, target=0.85)
