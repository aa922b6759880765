"""Imports every experiment so gin knows its configurables."""

from experiments import common, quickstart  # noqa: F401
