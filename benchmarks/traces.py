"""Shared trace reading for the GPU benchmark scripts (``python3 benchmarks/<script>.py``):
``experiments.profiling``'s, under the names the scripts import."""

from experiments.profiling import gpu_events, per_call, profile_program  # noqa: F401
