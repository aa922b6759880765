"""Imports every experiment so gin knows its configurables."""

from experiments import (  # noqa: F401
    accuracy,
    capacity,
    common,
    kernel_compare,
    quickstart,
    recall_study,
    replay,
    residency,
    scale,
    serve,
    speculative,
    tp,
    train,
    train_drafter,
)
