"""transformers' progress bars ("Loading weights", "Converting and de-quantizing GGUF tensors", a bar per saved
shard) drawn on stderr: useful on a terminal, noise in a log file or a command that answers in one line."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["transformers_bars_off"]


@contextlib.contextmanager
def transformers_bars_off(*, unless_terminal: bool = False) -> Iterator[None]:
    """Turn transformers' progress bars off for the block (and back on after, when they were on); with
    ``unless_terminal``, only when stderr is not a terminal (a log, CI), where a redrawn bar is unreadable."""
    if importlib.util.find_spec("transformers") is None or (unless_terminal and _stderr_is_terminal()):
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # Reading a GGUF file draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors") that transformers'
    # switch above does not reach: that module's tqdm is swapped for a silent one for the block.
    gguf = _gguf_module()
    plain = getattr(gguf, "tqdm", None)
    if plain is not None:
        gguf.tqdm = functools.partial(plain, disable=True)
    try:
        yield
    finally:
        if plain is not None:
            gguf.tqdm = plain
        if was_on:
            hf_logging.enable_progress_bar()


def _gguf_module() -> Any:
    try:
        return importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except Exception:  # noqa: BLE001 - an optional module that fails to import has no bar to silence
        return None


def _stderr_is_terminal() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False
