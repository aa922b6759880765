"""Imports every experiment so gin knows its configurables."""

from experiments import common, quickstart, recall_study  # noqa: F401
