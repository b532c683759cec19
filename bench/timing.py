"""One timed call, shared by the pytest-benchmark suites (which interleave ours and a baseline by hand)."""

from __future__ import annotations

import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Seconds for one call of ``fn``, waiting for the device to finish."""
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0
