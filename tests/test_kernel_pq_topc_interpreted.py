"""The jax-triton pq score kernel executed on the CPU by Triton's interpreter
(``pallas_kernels.pq_topc.interpreted``), every launch variant against the reference twin's
decomposition. Needs the triton package (a dev dependency); runs in a subprocess because the
interpreter must be on before the kernel is built."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "pq_interpreted_cases.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_variant_and_layout_ran(cases):
    from tests.pq_interpreted_cases import VARIANTS
    ran = {(c["variant"], c["layout"]) for c in cases}
    assert ran == {(v, lay) for v in VARIANTS for lay in ("contiguous", "paged")}


def test_interpreted_kernel_matches_its_decomposition(cases):
    """Each variant (code prefetch, book per tile, swizzled book, keys as the dot's B
    operand), contiguous and paged codes
    with lengths N, a partial tile and 0: -inf exactly past each length, and scores within
    f32 rounding of the kernel's math in jnp (e4m3 products are exact; only the order of
    the f32 sums differs)."""
    for c in cases:
        assert c["mask_ok"], c
        assert c["max_abs_err"] <= 1e-5 * c["scale"], c
