"""The jax-triton score kernel run by Triton's interpreter on the CPU (no GPU, no jax-triton).

``jax_triton.coarse_scores_jax_triton`` launches ``pq_scores_kernel`` through jax-triton,
which needs a CUDA GPU. Triton's interpreter (``TRITON_INTERPRET=1``) executes the same
kernel source with numpy, one program at a time, reading and writing host memory through
the pointers it is handed. ``interpreted_scores`` packs the inputs exactly as the jax-triton
launch does (``jax_triton.launch_inputs``) and hands the interpreter numpy arrays, so CPU
tests run the kernel's own indexing, masks, page-table reads and launch variants
(``jax_triton.Params``) against the reference twin. Lowering-level effects (layouts, bank
conflicts, registers) are not modelled: those are the PTX tests' and the GPU's.

The interpreter must be on before the kernel is first built (``triton.jit`` reads the
setting at decoration time, and the kernel is built once per process): set
``TRITON_INTERPRET=1`` in the environment of a fresh process (tests run this module in a
subprocess). Needs the triton package.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.pq_topc import jax_triton as jt

_TORCH_NAMES = {"uint8": "uint8", "int32": "int32", "uint32": "int32", "float32": "float32",
                "bfloat16": "bfloat16"}


class HostArray:
    """A contiguous numpy array as the interpreter's pointer argument (the attributes
    Triton's launcher reads of a tensor: ``data_ptr`` and a torch-style ``dtype`` name)."""

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array)
        if self.array.dtype.name not in _TORCH_NAMES:
            raise TypeError(f"interpreted_scores: no pointer type for {self.array.dtype}")
        self.dtype = "torch." + _TORCH_NAMES[self.array.dtype.name]

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def _check_interpreter():
    import triton
    from triton.runtime import interpreter
    if not triton.knobs.runtime.interpret or not isinstance(jt._kernel(),
                                                             interpreter.InterpretedFunction):
        raise RuntimeError("interpreted_scores: Triton's interpreter is off; set "
                           "TRITON_INTERPRET=1 before this process builds the kernel")
    return interpreter


def interpreted_scores(q, weights, codes, codebooks, lengths, *, params=None,
                       precision: str = "bf16", page_table=None, page: int | None = None):
    """``coarse_scores_jax_triton``'s masked scores [B, N] f32 (numpy), computed by the same
    kernel under Triton's interpreter. Same arguments and launch."""
    interpreter = _check_interpreter()
    args, consts, grid, p = jt.launch_inputs(q, weights, codes, codebooks, lengths,
                                             params=params, precision=precision,
                                             page_table=page_table, page=page)
    host = [np.asarray(a) for a in args]
    out = np.zeros((host[0].shape[0], consts["N"]), np.float32)
    # the arrays already live in host memory: no device copies around the run
    executor = interpreter.GridExecutor
    saved = executor._init_args_hst, executor._restore_args_dev
    executor._init_args_hst = lambda self, a, k: (a, k)
    executor._restore_args_dev = lambda self, *a: None
    try:
        jt._kernel()[grid](*[HostArray(a) for a in host], HostArray(out),
                           num_warps=p.num_warps, **consts)
    finally:
        executor._init_args_hst, executor._restore_args_dev = saved
    return out
