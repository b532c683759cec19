"""Palestra: an RL gym for language models."""

__version__ = "0.1.0"
