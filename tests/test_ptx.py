"""``pallas_kernels.ptx``: a Pallas-Triton kernel's IR through the TTIR stage's passes (as XLA's
Triton pipeline runs them on the GPU) before the sm_90 stages, so the PTX and ptxas counts that
``benchmarks/pallas_ptx.py`` reports are those of the kernel the GPU runs."""

import re

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.ptx import triton_ir_text, ttir_passes
from pallas_kernels.sparse_attention.triton import sparse_attention_triton

S = jax.ShapeDtypeStruct
DOT = re.compile(r"(%[\w#]+) = tt\.dot (%[\w#]+), (%[\w#]+), (%[\w#]+)")


def _zero_accumulators(ttir: str) -> tuple[int, int]:
    """(tt.dot ops, those whose accumulator is a constant zero: an arith.constant 0 or a
    tt.splat of one). SSA names repeat across regions: a name means its nearest definition
    above the use."""
    lines = ttir.splitlines()

    def definition(name, before):
        for line in reversed(lines[:before]):
            m = re.match(r"\s*(%[\w#]+) = (.*)", line)
            if m and m[1] == name:
                return m[2]
        return ""

    def zero(name, at):
        d = definition(name, at)
        if d.startswith("tt.splat"):
            return zero(d.split()[1].rstrip(","), at)
        return d.startswith("arith.constant") and re.search(r"\b0\.0+e\+00\b", d) is not None

    dots = [(i, m) for i, line in enumerate(lines) if (m := DOT.search(line))]
    return len(dots), sum(zero(m[4], i) for i, m in dots)


def _attention():
    bf16 = jnp.bfloat16
    specs = (S((2, 64, 64), bf16), S((2, 128, 64), bf16), S((2, 32), jnp.int32),
             S((2, 16, 64), bf16), S((2, 16), bool), S((64,), jnp.float32))
    return sparse_attention_triton, specs


def test_ttir_passes_fold_the_accumulator_update_into_the_dot():
    """sparse_attention's online softmax writes acc * alpha + dot(p, v): as Pallas emits it
    every tt.dot starts from a zero accumulator; after the TTIR stage (Triton's combine) the
    two p . v dots (selected and window blocks) accumulate into acc * alpha, so wgmma keeps
    one [BH, D] accumulator instead of two. The q . rows dots keep their zero."""
    fn, specs = _attention()
    raw = triton_ir_text(common.lower_for_cuda(fn, *specs))
    assert _zero_accumulators(raw) == (4, 4)
    assert _zero_accumulators(ttir_passes(raw, 8, 2)) == (4, 2)



def test_sass_loops_counts_each_backward_branchs_body():
    """``benchmarks/pallas_ptx.py``'s loop census of nvdisasm text: a backward branch's body
    from its label, predicates and modifiers stripped (also a branch with a second
    predicate); forward branches and the kernel's closing branch-to-itself are not loops."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pallas_ptx.py"
    spec = importlib.util.spec_from_file_location("pallas_ptx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sass_loops = module.sass_loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/                   FSETP.GE.AND P1, PT, R2, R3, PT ;
        /*0030*/               @P1 STG.E desc[UR4][R4.64], R5 ;
        /*0040*/                   IMAD.IADD R6, R6, 0x1, R7 ;
        /*0050*/                   ISETP.GE.AND P2, PT, R6, R8, PT ;
        /*0060*/              @!P2 BRA `(.L_x_0) ;
.L_x_1:
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""
    assert sass_loops(sass) == [{"instructions": 5, "ops": {"FSETP": 1, "STG": 1, "IMAD": 1,
                                                            "ISETP": 1, "BRA": 1}}]
    # a loop closed by a branch with a second predicate (a while loop's exit test; before
    # session 48 the census missed the finish kernel's search loop of this form)
    two = sass.replace("@!P2 BRA `(.L_x_0)", "@P3 BRA P2, `(.L_x_0)")
    assert sass_loops(two) == sass_loops(sass)
