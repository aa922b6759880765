"""Imports every experiment so gin knows its configurables."""

from experiments import common, kernel_compare, quickstart, recall_study, train  # noqa: F401
