"""benchmarks/kernel_ncu_gpu.py --sass on a synthetic source page in ncu 2025's CSV form: stall
samples split by kernel, instruction, opcode (predicates dropped) and reason, shares exact."""

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "kernel_ncu_gpu", pathlib.Path(__file__).parents[1] / "benchmarks" / "kernel_ncu_gpu.py")
ncu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu)

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb",'
        '"stall_barrier (Not Issued)"')


def page(tmp_path):
    lines = ['"Kernel Name","select",', HEAD,
             '"0x10","      LDG.E R2, desc[UR4][R4.64]","10","8","0","10","0"',
             '"0x20","@P0   BAR.SYNC.DEFER_BLOCKING 0x0","25","20","25","0","20"',
             '"0x30","      BAR.SYNC.DEFER_BLOCKING 0x0","5","5","5","0","5"',
             '"Kernel Name","finish",', HEAD,
             '"0x40","      FMUL R1, R2, R3","4","4","0","4","0"']
    path = tmp_path / "sass_op.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_samples_by_kernel_instruction_opcode_and_reason(tmp_path):
    select, finish = ncu.sass_summary([str(page(tmp_path))])
    assert (select["kernel"], select["instructions"], select["samples"]) == ("select", 3, 40.0)
    assert dict(select["by_opcode"]) == {"BAR.SYNC.DEFER_BLOCKING": 0.75, "LDG.E": 0.25}
    assert dict(select["by_stall"]) == {"barrier": 0.75, "long_sb": 0.25}  # not-issued apart
    top = select["top"][0]
    assert (top["address"], top["share"], top["stalls"]) == ("0x20", 0.625, {"barrier": 25.0})
    assert (finish["kernel"], finish["samples"], dict(finish["by_opcode"])) == (
        "finish", 4.0, {"FMUL": 1.0})


def test_a_page_without_sampling_columns_is_reported_not_summarized(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text('"Kernel Name","k",\n"Address","Source"\n"0x0","NOP"\n')
    assert ncu.sass_summary([str(path)]) == []
    assert "no sampling column" in capsys.readouterr().out


def test_a_missing_page_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ncu.sass_summary([str(tmp_path / "absent.csv")])
