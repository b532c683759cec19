"""Exact comparison of nested values (states, outputs, observations): where two of them first differ.

Bitwise for tensors and arrays (NaN equals NaN in the same place: a restored NaN is a faithful copy), ``==``
for everything else. The answer is a path such as ``['optimizer']['state'][0]['exp_avg']``, so a failed
round-trip names the entry that did not survive.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["first_difference"]


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """None when ``a`` and ``b`` are equal all the way down; else a one-line description of the first difference."""
    import torch

    here = path or "the value"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, here)
    if _is_array(a) or _is_array(b):
        return _array_difference(a, b, here)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            missing, extra = sorted(map(str, set(a) - set(b))), sorted(map(str, set(b) - set(a)))
            return (
                f"{here}: keys differ (only in the first: {missing or 'none'}; only in the second: {extra or 'none'})"
            )
        for key in a:
            found = first_difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{here}: {len(a)} entries != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if dataclasses.is_dataclass(a) and type(a) is type(b) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            found = first_difference(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    try:
        same = bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == is ambiguous or raises: its text is the best we have
        same = repr(a) == repr(b)
    return None if same else f"{here}: {_short(a)} != {_short(b)}"


def _tensor_difference(a: Any, b: Any, here: str) -> str | None:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{here}: {type(a).__name__} != {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{here}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
    x, y = a.detach().cpu(), b.detach().cpu()
    if x.is_floating_point() or x.is_complex():
        same_nan = torch.equal(torch.isnan(x), torch.isnan(y))
        same = same_nan and torch.equal(torch.nan_to_num(x, nan=0.0), torch.nan_to_num(y, nan=0.0))
    else:
        same = torch.equal(x, y)
    if same:
        return None
    where = (x != y).nonzero()
    first = tuple(where[0].tolist()) if where.numel() else ()
    detail = f" (first at {list(first)}: {x[first].item()} != {y[first].item()})" if first else ""
    return f"{here}: tensors differ{detail}"


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape")


def _array_difference(a: Any, b: Any, here: str) -> str | None:
    import numpy as np

    if not (_is_array(a) and _is_array(b)):
        return f"{here}: {type(a).__name__} != {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{here}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
    equal_nan = a.dtype.kind in "fc"
    return None if np.array_equal(a, b, equal_nan=equal_nan) else f"{here}: arrays differ"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
