"""One-line errors for the RL math's tensor inputs: each names the function, the tensor and its shape."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FLOAT_DTYPES", "INT_DTYPES", "as_mask", "check_same_shape", "check_tensor", "shape_str"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(fn: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """``t`` itself, when it is a tensor of one of ``dtypes``; else a one-line TypeError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: {name} has dtype {str(t.dtype).removeprefix('torch.')}, expected one of {allowed}")
    return t


def check_same_shape(fn: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{fn}: {name} has shape {shape_str(t)}, expected {shape_str(ref)} (the shape of {ref_name})")
    if t.device != ref.device:
        raise ValueError(f"{fn}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def as_mask(fn: str, mask: Any, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """The mask as bool (numeric masks: nonzero means valid); ``None`` means every position is valid."""
    if mask is None:
        return torch.ones(ref.shape, dtype=torch.bool, device=ref.device)
    check_tensor(fn, "mask", mask)
    check_same_shape(fn, "mask", mask, ref_name, ref)
    return mask.detach() if mask.dtype == torch.bool else mask.detach() != 0


def per_token(fn: str, name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """``x`` as ``ref``'s shape: per token already, or one value per row repeated over the row's tokens."""
    if x.shape == ref.shape:
        return x
    if ref.dim() >= 1 and x.dim() == 1 and x.shape[0] == ref.shape[0]:
        return x.reshape((-1,) + (1,) * (ref.dim() - 1)).expand(ref.shape)
    rows = ref.shape[0] if ref.dim() else 1
    raise ValueError(
        f"{fn}: {name} has shape {shape_str(x)}, expected "
        f"{shape_str(ref)} or [{rows}] (per token or per row of {ref_name})"
    )
