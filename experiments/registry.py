"""Imports every experiment so gin knows its configurables."""

from experiments import (  # noqa: F401
    accuracy,
    common,
    kernel_compare,
    quickstart,
    recall_study,
    residency,
    scale,
    serve,
    speculative,
    tp,
    train,
    train_drafter,
)
