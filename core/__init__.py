"""Palestra: an RL gym for language models."""

from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
