"""Shared helpers for the ops: input checks with one-line errors, and Triton launch settings."""

from __future__ import annotations

import torch

__all__ = ["check", "check_tensor", "dtype_name", "next_power_of_2", "shape_str", "triton_launch_settings"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check(cond: bool, op: str, message: str) -> None:
    """Raise a one-line ``ValueError`` naming the op when ``cond`` is false."""
    if not cond:
        raise ValueError(f"{op}: {message}")


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
) -> None:
    """Check that argument ``name`` of ``op`` is a tensor of an allowed dtype and rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}, expected one of {allowed}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed_nd:
            raise ValueError(
                f"{op}: {name} has shape {shape_str(t)}, expected {' or '.join(map(str, allowed_nd))} dims"
            )
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{op}: {name} has shape {shape_str(t)}, expected at least {min_ndim} dims")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def triton_launch_settings(n_cols: int, element_size: int = 4, max_block: int = 8192) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row-wise Triton kernel that streams a row in chunks of BLOCK columns."""
    block = min(max_block, next_power_of_2(n_cols))
    if block >= 8192:
        warps = 16
    elif block >= 2048:
        warps = 8
    elif block >= 512:
        warps = 4
    else:
        warps = 2
    return block, warps
