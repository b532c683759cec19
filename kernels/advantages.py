"""Advantage estimators: GAE, discounted returns (REINFORCE++), group advantages (GRPO / Dr.GRPO), RLOO.

Each op has four back ends behind a :class:`~palestra.kernels.dispatch.KernelOp`: the plain-torch
reference, the C++ CPU kernel (``torch.ops.palestra.<op>``), the CUDA kernel (same op, CUDA key) and a
Triton kernel (``torch.ops.palestra_triton.<op>``, imported only when that back end is used).

Conventions shared by all four ops:

* Outputs are float32 whatever the input dtype (float32, bfloat16, float16 or float64 inputs are
  accepted and converted to float32 before the kernels run).
* Inputs are data, not parameters: none of these ops is differentiable. Tensors that require grad are
  **detached** (as verl / TRL compute advantages under ``torch.no_grad``); the outputs never require grad.
* Bad input raises a one-line ``ValueError`` / ``TypeError`` naming the argument and its shape or dtype.

Padding semantics of :func:`gae` and :func:`discounted_returns`: ``mask`` marks the valid steps of each
row and padding may sit anywhere (left, right, gaps). The recursion runs over each row's valid steps only,
as if the padding were cut out: a padding step neither resets nor discounts anything, and its outputs are 0.
"""

from __future__ import annotations

import numbers

import torch

from .build import CPU_LIBRARY, CUDA_LIBRARY
from .dispatch import KernelOp
from .utils import check, check_tensor, dtype_name, shape_str

__all__ = [
    "SCALES",
    "discounted_returns",
    "discounted_returns_reference",
    "gae",
    "gae_reference",
    "group_advantages",
    "group_advantages_reference",
    "masked_whiten",
    "rloo_advantages",
    "rloo_advantages_reference",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# group_advantages' scale argument, as the int the C++ schema takes.
SCALES = {"none": 0, "group": 1, "batch": 2}


# ---------------------------------------------------------------------------------------------------
# Input checks and conversion
# ---------------------------------------------------------------------------------------------------
def _check_unit_interval(op: str, name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(x).__name__}")
    x = float(x)
    check(0.0 <= x <= 1.0, op, f"{name} must be in [0, 1], got {x}")
    return x


def _check_same_device(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    check(t.device == ref.device, op, f"{name} is on {t.device} but rewards is on {ref.device}")


def _as_float32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32 and not t.requires_grad and t.is_contiguous():
        return t  # the common case, without three tensor calls
    return t.detach().to(torch.float32).contiguous()


def _as_mask(op: str, mask, rewards: torch.Tensor) -> torch.Tensor:
    """The mask as a contiguous bool tensor (numeric masks: nonzero means valid)."""
    check_tensor(op, "mask", mask)
    check(
        not mask.is_complex(),
        op,
        f"mask has dtype {dtype_name(mask.dtype)}, expected bool or a real 0/1 dtype",
    )
    check(
        mask.shape == rewards.shape,
        op,
        f"mask has shape {shape_str(mask)}, expected {shape_str(rewards)} (the shape of rewards)",
    )
    _check_same_device(op, "mask", mask, rewards)
    mask = mask.detach()
    if mask.dtype != torch.bool:
        mask = mask != 0
    return mask.contiguous()


def _check_sequences(op: str, rewards) -> None:
    check_tensor(op, "rewards", rewards, dtypes=FLOAT_DTYPES, ndim=(1, 2))


def _bootstrap(op: str, bootstrap_value, rewards: torch.Tensor, one_row: bool) -> torch.Tensor:
    """bootstrap_value as a float32 [B] tensor: None -> zeros (terminal), a number -> that value for every row."""
    B = rewards.shape[0]
    if bootstrap_value is None:
        return torch.zeros(B, dtype=torch.float32, device=rewards.device)
    if isinstance(bootstrap_value, numbers.Real) and not isinstance(bootstrap_value, bool):
        return torch.full((B,), float(bootstrap_value), dtype=torch.float32, device=rewards.device)
    check_tensor(op, "bootstrap_value", bootstrap_value, dtypes=FLOAT_DTYPES)
    expected = "[] or [1]" if one_row else f"[{B}]"
    ok = bootstrap_value.dim() <= 1 and bootstrap_value.numel() == 1 if one_row else bootstrap_value.shape == (B,)
    check(
        ok,
        op,
        f"bootstrap_value has shape {shape_str(bootstrap_value)}, expected {expected} (one value per row of rewards)",
    )
    _check_same_device(op, "bootstrap_value", bootstrap_value, rewards)
    return _as_float32(bootstrap_value.reshape(B))


# ---------------------------------------------------------------------------------------------------
# Plain-torch references (vectorised across rows, a Python loop over time for the recursions)
# ---------------------------------------------------------------------------------------------------
def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    bootstrap_value: torch.Tensor,
    gamma: float,
    lam: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over [B, T] rows by a reverse loop over time, computed in ``dtype``; returns ``dtype`` tensors.

    The carries are the advantage and the value of the next *valid* step; a padding step leaves both
    as they are, so padding is skipped wherever it sits.
    """
    r, v, b = rewards.to(dtype), values.to(dtype), bootstrap_value.to(dtype)
    m = mask.to(torch.bool)
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=dtype, device=r.device)
    next_adv = torch.zeros(B, dtype=dtype, device=r.device)
    next_value = b.clone()
    for t in range(T - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + (gamma * lam) * next_adv
        adv[:, t] = torch.where(valid, a, 0.0)
        next_adv = torch.where(valid, a, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def discounted_returns_reference(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Discounted reward-to-go over each row's valid steps, by a reverse loop over time in ``dtype``."""
    r = rewards.to(dtype)
    m = mask.to(torch.bool)
    B, T = r.shape
    out = torch.zeros(B, T, dtype=dtype, device=r.device)
    running = torch.zeros(B, dtype=dtype, device=r.device)
    for t in range(T - 1, -1, -1):
        valid = m[:, t]
        g = r[:, t] + gamma * running
        out[:, t] = torch.where(valid, g, 0.0)
        running = torch.where(valid, g, running)
    return out


def _group_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std along the last dim; the std of a single element is defined as 0."""
    n = x.shape[-1]
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / max(n - 1, 1)
    return mean, var.sqrt()


def group_advantages_reference(
    rewards: torch.Tensor, group_size: int, scale: str, eps: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    x = rewards.to(dtype).reshape(-1, group_size)
    if scale == "none":  # no std to compute (the torch back end of scale="none"; same mean as _group_stats)
        return (x - x.mean(-1, keepdim=True)).reshape(-1)
    mean, std = _group_stats(x)
    centred = x - mean
    if scale == "group":
        centred = centred / (std + eps)
    elif scale == "batch":
        centred = centred / (_group_stats(x.reshape(1, -1))[1] + eps)
    return centred.reshape(-1)


def rloo_advantages_reference(
    rewards: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    x = rewards.to(dtype).reshape(-1, group_size)
    loo_mean = (x.sum(-1, keepdim=True) - x) / (group_size - 1)
    return (x - loo_mean).reshape(-1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over the valid positions of the whole
    batch; padding stays 0. With fewer than two valid positions every output is 0."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    centred = (x - mean) * m
    var = (centred * centred).sum() / (n - 1).clamp(min=1)
    return centred * torch.rsqrt(var + eps)


# ---------------------------------------------------------------------------------------------------
# Back ends
# ---------------------------------------------------------------------------------------------------
_gae = KernelOp("gae")
_discounted = KernelOp("discounted_returns")
# group_advantages is dispatched per scale: the benchmark times scale="group" and scale="none" as two ops,
# and they differ in which back end ``auto`` may use (dispatch.AUTO_BACKENDS). Both have the same back ends.
_group = KernelOp("group_advantages")  # scale="group" (GRPO) and "batch"
_group_none = KernelOp("group_advantages[none]")  # scale="none" (Dr.GRPO)
_rloo = KernelOp("rloo_advantages")


# The torch back end accumulates in float64: a float32 carry drifts at long T when gamma * lam is close
# to 1 (gamma * lam itself rounds in float32, and the error compounds), and the reference must be exact.
@_gae.register("torch")
def _gae_torch(rewards, values, mask, bootstrap_value, gamma, lam):
    adv, ret = gae_reference(rewards, values, mask, bootstrap_value, gamma, lam, dtype=torch.float64)
    return adv.float(), ret.float()


@_gae.register("cpp", CPU_LIBRARY)
@_gae.register("cuda", CUDA_LIBRARY)
def _gae_native(rewards, values, mask, bootstrap_value, gamma, lam):
    return torch.ops.palestra.gae(rewards, values, mask, bootstrap_value, gamma, lam)


@_gae.register("triton")
def _gae_triton(rewards, values, mask, bootstrap_value, gamma, lam):
    from . import triton_advantages  # noqa: F401  (registers torch.ops.palestra_triton.*)

    return torch.ops.palestra_triton.gae(rewards, values, mask, bootstrap_value, gamma, lam)


@_discounted.register("torch")
def _discounted_torch(rewards, mask, gamma):
    return discounted_returns_reference(rewards, mask, gamma, dtype=torch.float64).float()


@_discounted.register("cpp", CPU_LIBRARY)
@_discounted.register("cuda", CUDA_LIBRARY)
def _discounted_native(rewards, mask, gamma):
    return torch.ops.palestra.discounted_returns(rewards, mask, gamma)


@_discounted.register("triton")
def _discounted_triton(rewards, mask, gamma):
    from . import triton_advantages  # noqa: F401

    return torch.ops.palestra_triton.discounted_returns(rewards, mask, gamma)


_SCALE_NAMES = {v: k for k, v in SCALES.items()}


@_group_none.register("torch")
@_group.register("torch")
def _group_torch(rewards, group_size, scale, eps):
    return group_advantages_reference(rewards, group_size, _SCALE_NAMES[scale], eps).float()


@_group_none.register("cpp", CPU_LIBRARY)
@_group_none.register("cuda", CUDA_LIBRARY)
@_group.register("cpp", CPU_LIBRARY)
@_group.register("cuda", CUDA_LIBRARY)
def _group_native(rewards, group_size, scale, eps):
    return torch.ops.palestra.group_advantages(rewards, group_size, scale, eps)


@_group_none.register("triton")
@_group.register("triton")
def _group_triton(rewards, group_size, scale, eps):
    from . import triton_advantages  # noqa: F401

    return torch.ops.palestra_triton.group_advantages(rewards, group_size, scale, eps)


@_rloo.register("torch")
def _rloo_torch(rewards, group_size):
    return rloo_advantages_reference(rewards, group_size).float()


@_rloo.register("cpp", CPU_LIBRARY)
@_rloo.register("cuda", CUDA_LIBRARY)
def _rloo_native(rewards, group_size):
    return torch.ops.palestra.rloo_advantages(rewards, group_size)


@_rloo.register("triton")
def _rloo_triton(rewards, group_size):
    from . import triton_advantages  # noqa: F401

    return torch.ops.palestra_triton.rloo_advantages(rewards, group_size)


def _register_fakes() -> None:
    """Shape-only (fake) kernels so torch.compile and opcheck can trace the C++/CUDA ops."""

    def _floats_like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=torch.float32, device=t.device)

    @torch.library.register_fake("palestra::gae")
    def _(rewards, values, mask, bootstrap_value, gamma, lam):
        return _floats_like(rewards), _floats_like(rewards)

    @torch.library.register_fake("palestra::discounted_returns")
    def _(rewards, mask, gamma):
        return _floats_like(rewards)

    @torch.library.register_fake("palestra::group_advantages")
    def _(rewards, group_size, scale, eps):
        return _floats_like(rewards)

    @torch.library.register_fake("palestra::rloo_advantages")
    def _(rewards, group_size):
        return _floats_like(rewards)


CPU_LIBRARY.on_load(_register_fakes)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    bootstrap_value: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over padded sequences, by an exact backward recursion.

    Args:
        rewards, values: [B, T] (or [T] for one row), float32/bfloat16/float16/float64.
        mask: [B, T] bool (or 0/1 numbers, nonzero = valid). Padding may sit anywhere; the recursion
            ``A_t = r_t + gamma * V(next valid) - V_t + gamma * lam * A(next valid)`` runs over each row's
            valid steps only.
        gamma, lam: discount and GAE lambda, in [0, 1].
        bootstrap_value: the value after each row's last valid step ([B], or a number for every row);
            ``None`` means 0, i.e. every row ends in a terminal state.

    Returns:
        ``(advantages, returns)``, float32 of the shape of ``rewards``; ``returns = advantages + values``
        at valid steps; both are 0 at padding. Inputs requiring grad are detached.
    """
    op = "gae"
    _check_sequences(op, rewards)
    check_tensor(op, "values", values, dtypes=FLOAT_DTYPES)
    check(
        values.shape == rewards.shape,
        op,
        f"values has shape {shape_str(values)}, expected {shape_str(rewards)} (the shape of rewards)",
    )
    _check_same_device(op, "values", values, rewards)
    gamma = _check_unit_interval(op, "gamma", gamma)
    lam = _check_unit_interval(op, "lam", lam)
    one_row = rewards.dim() == 1
    mask = _as_mask(op, mask, rewards)
    r2 = rewards.unsqueeze(0) if one_row else rewards
    boot = _bootstrap(op, bootstrap_value, r2, one_row)
    r, v, m = _as_float32(r2), _as_float32(values.reshape(r2.shape)), mask.reshape(r2.shape)
    adv, ret = _gae(r.device)(r, v, m, boot, gamma, lam)
    return (adv[0], ret[0]) if one_row else (adv, ret)


def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, whiten: bool = True, *, eps: float = 1e-8
) -> torch.Tensor:
    """Discounted reward-to-go over valid steps (REINFORCE++), optionally whitened.

    ``G_t = r_t + gamma * G(next valid step)`` over each row's valid steps (padding anywhere is skipped;
    the step after the last valid one contributes 0). With ``whiten`` the returns are normalised as
    :func:`masked_whiten` does: mean and unbiased variance over the valid positions of the whole batch,
    ``(G - mean) / sqrt(var + eps)``; padding stays 0.

    Args:
        rewards: [B, T] or [T], a float dtype. mask: same shape, bool or 0/1 numbers.
        gamma: discount in [0, 1].
    Returns:
        float32 tensor of the shape of ``rewards``.
    """
    op = "discounted_returns"
    _check_sequences(op, rewards)
    gamma = _check_unit_interval(op, "gamma", gamma)
    check(isinstance(eps, numbers.Real) and eps >= 0, op, f"eps must be a number >= 0, got {eps!r}")
    mask = _as_mask(op, mask, rewards)
    one_row = rewards.dim() == 1
    r = _as_float32(rewards.reshape(1, -1) if one_row else rewards)
    m = mask.reshape(r.shape)
    out = _discounted(r.device)(r, m, gamma)
    if whiten:
        out = masked_whiten(out, m, float(eps))
    return out[0] if one_row else out


def _check_groups(op: str, rewards, group_size, min_size: int) -> None:
    check_tensor(op, "rewards", rewards, dtypes=FLOAT_DTYPES, ndim=1)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{op}: group_size must be an int, got {type(group_size).__name__}")
    check(int(group_size) >= min_size, op, f"group_size must be >= {min_size}, got {group_size}")
    B = rewards.shape[0]
    check(
        B % group_size == 0,
        op,
        f"group_size {group_size} does not divide the batch size {B} (rewards has shape {shape_str(rewards)})",
    )


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """GRPO-style advantages: each reward minus its group's mean, optionally scaled.

    Groups are contiguous blocks of ``group_size`` rewards (all completions of one prompt together).

    * ``scale="group"`` (GRPO): divided by ``group std + eps``.
    * ``scale="batch"``: divided by the whole batch's ``std + eps`` (TRL's ``scale_rewards="batch"``).
    * ``scale="none"`` (Dr.GRPO): mean-centred only.

    The std is the **unbiased** one (divides by n - 1), as TRL and verl use. A group of one has std 0
    (not NaN), so with ``group_size=1`` every advantage is 0 (a reward minus its own mean).

    Args:
        rewards: [B] float, B a multiple of ``group_size``.
        eps: added to the std (must be > 0 when scaling, so that groups of equal rewards give 0, not NaN).
    Returns:
        float32 [B].
    """
    op = "group_advantages"
    _check_groups(op, rewards, group_size, 1)
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"{op}: unknown scale {scale!r}; choose one of {', '.join(map(repr, SCALES))}")
    check(isinstance(eps, numbers.Real) and not isinstance(eps, bool), op, f"eps must be a number, got {eps!r}")
    check(
        eps > 0 or scale == "none",
        op,
        f"eps must be > 0 with scale={scale!r} (a group of equal rewards has std 0), got {eps}",
    )
    r = _as_float32(rewards)
    kernel = _group_none if scale == "none" else _group
    return kernel(r.device)(r, int(group_size), SCALES[scale], float(eps))


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean of the *other* members of its group.

    Groups are contiguous blocks of ``group_size`` (>= 2) rewards. Returns float32 [B].
    """
    op = "rloo_advantages"
    _check_groups(op, rewards, group_size, 2)
    r = _as_float32(rewards)
    return _rloo(r.device)(r, int(group_size))
