"""Triton kernels for the advantage estimators, wrapped as ``torch.ops.palestra_triton.*`` custom ops.

Imported only when the triton back end is used (importing :mod:`palestra.kernels` never imports triton).
The ops are opaque ``torch.library.custom_op`` s with fake (shape) kernels rather than ``triton_op`` s:
under ``TRITON_INTERPRET=1`` (how CI runs them) ``wrap_triton`` hands back the interpreted kernel, which
neither fake tensors nor torch.compile can trace; an opaque op works the same on both.

GAE / discounted returns: one program per row walks the row in tiles from the end. Inside a tile the
recursion is solved by ``tl.associative_scan`` in *scan order* = descending time (the tile is loaded
back to front, so a plain forward scan runs backwards in time; we do not rely on ``reverse=True``'s
argument order). Two scans per tile:

1. the value of the next valid step after each t (a "nearest valid wins" select over the step after t);
2. the first-order recurrence ``A <- delta + c * A`` over valid steps (padding is the identity map),
   as composed affine maps ``x -> c**n * x + b``. The multiplier is kept as the integer count ``n`` and
   evaluated as ``exp2(n * log2(c))``: accurate to a few fp32 ulps whatever n, unlike a running product
   of the fp32-rounded c, whose error compounds over long rows when gamma * lam is close to 1.

The tile's carries (advantage and value of the nearest valid step after it) feed the next tile.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .utils import next_power_of_2

__all__ = ["discounted_returns", "gae", "group_advantages", "rloo_advantages"]

# log2(0) = -inf would make exp2(0 * log2c) NaN for n = 0; any value this negative already sends
# c**n (n >= 1) to exactly 0 in fp32, which is what c = 0 means.
_LOG2_FLOOR = -1.0e4


def _log2(c: float) -> float:
    return max(math.log2(c), _LOG2_FLOOR) if c > 0 else _LOG2_FLOOR


# Largest tile (steps per scan / rewards per block); tests lower it to run several tiles on tiny rows.
MAX_TILE = 1024


def _tile(n: int) -> int:
    return max(16, min(MAX_TILE, next_power_of_2(n)))


@triton.jit
def _nearest_valid(h1, v1, h2, v2):
    # Element 2 comes later in scan order, i.e. earlier in time: it is nearer to the steps still to be
    # scanned, so its valid value wins.
    return h1 | h2, tl.where(h2 != 0, v2, v1)


@triton.jit
def _compose(n1, b1, l1, n2, b2, l2):
    # Apply x -> c**n1 x + b1, then x -> c**n2 x + b2. l = log2(c) rides along in the tuple because a
    # combine function receives nothing but the scanned elements.
    return n1 + n2, b2 + tl.exp2(n2.to(tl.float32) * l2) * b1, l2


@triton.jit
def _reverse_scan_kernel(
    r_ptr,
    v_ptr,
    m_ptr,
    boot_ptr,
    adv_ptr,
    ret_ptr,
    T,
    gamma,
    log2c,
    HAS_VALUES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    s = tl.arange(0, BLOCK)
    is_last = s == BLOCK - 1
    log2c_vec = tl.zeros([BLOCK], dtype=tl.float32) + log2c
    if HAS_VALUES:
        next_value = tl.load(boot_ptr + row)  # value of the nearest valid step after the current tile
    else:
        next_value = 0.0
    next_adv = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)  # advantage of the nearest valid step after the tile
    for start in range(0, T, BLOCK):
        t = T - 1 - start - s  # descending times
        inb = t >= 0
        valid = tl.load(m_ptr + base + t, mask=inb, other=0) != 0
        r = tl.load(r_ptr + base + t, mask=inb, other=0.0)
        if HAS_VALUES:
            v = tl.load(v_ptr + base + t, mask=inb, other=0.0)
            after = inb & (t + 1 < T)  # the step after t, read straight from memory (it may sit in the previous tile)
            h_after = tl.load(m_ptr + base + t + 1, mask=after, other=0).to(tl.int32)
            v_after = tl.load(v_ptr + base + t + 1, mask=after, other=0.0)
            found, nearest = tl.associative_scan((h_after, v_after), 0, _nearest_valid)
            v_next = tl.where(found != 0, nearest, next_value)
            delta = r - v + gamma * v_next
        else:
            delta = r
        delta = tl.where(valid, delta, 0.0)
        n, b, _ = tl.associative_scan((valid.to(tl.int32), delta, log2c_vec), 0, _compose)
        a = b + tl.exp2(n.to(tl.float32) * log2c) * next_adv
        tl.store(adv_ptr + base + t, tl.where(valid, a, 0.0), mask=inb)
        if HAS_VALUES:
            tl.store(ret_ptr + base + t, tl.where(valid, a + v, 0.0), mask=inb)
            next_value = tl.sum(tl.where(is_last, v_next, 0.0), 0)
        next_adv = tl.sum(tl.where(is_last, a, 0.0), 0)


@triton.jit
def _batch_std_kernel(r_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        acc += tl.load(r_ptr + idx, mask=idx < N, other=0.0)
    mean = tl.sum(acc, 0) / N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        d = tl.where(idx < N, tl.load(r_ptr + idx, mask=idx < N, other=0.0) - mean, 0.0)
        acc += d * d
    var = tl.sum(acc, 0) / tl.maximum(N - 1, 1)
    tl.store(out_ptr, tl.sqrt(var))


@triton.jit
def _group_kernel(r_ptr, out_ptr, std_ptr, group_size, eps, factor, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: mean-centred; 1: / (group std + eps); 2: / (batch std + eps), std_ptr[0] = batch std;
    # 3: RLOO, factor * (r - mean) with factor = k / (k - 1).
    base = tl.program_id(0).to(tl.int64) * group_size
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, group_size, BLOCK):
        idx = start + offs
        acc += tl.load(r_ptr + base + idx, mask=idx < group_size, other=0.0)
    mean = tl.sum(acc, 0) / group_size
    denom = 1.0
    if MODE == 1:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, group_size, BLOCK):
            idx = start + offs
            d = tl.where(idx < group_size, tl.load(r_ptr + base + idx, mask=idx < group_size, other=0.0) - mean, 0.0)
            acc += d * d
        denom = tl.sqrt(tl.sum(acc, 0) / tl.maximum(group_size - 1, 1)) + eps
    if MODE == 2:
        denom = tl.load(std_ptr) + eps
    for start in range(0, group_size, BLOCK):
        idx = start + offs
        x = tl.load(r_ptr + base + idx, mask=idx < group_size, other=0.0)
        if MODE == 3:
            y = (x - mean) * factor
        else:
            y = (x - mean) / denom
        tl.store(out_ptr + base + idx, y, mask=idx < group_size)


@torch.library.custom_op("palestra_triton::gae", mutates_args=())
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    bootstrap_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = rewards.shape
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    if B > 0 and T > 0:
        _reverse_scan_kernel[(B,)](
            rewards,
            values,
            mask.view(torch.uint8),
            bootstrap_value,
            adv,
            ret,
            T,
            gamma,
            _log2(gamma * lam),
            HAS_VALUES=True,
            BLOCK=_tile(T),
        )
    return adv, ret


@torch.library.custom_op("palestra_triton::discounted_returns", mutates_args=())
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    B, T = rewards.shape
    out = torch.empty_like(rewards)
    if B > 0 and T > 0:
        # values / bootstrap / returns pointers are unused with HAS_VALUES=False
        _reverse_scan_kernel[(B,)](
            rewards,
            rewards,
            mask.view(torch.uint8),
            rewards,
            out,
            out,
            T,
            gamma,
            _log2(gamma),
            HAS_VALUES=False,
            BLOCK=_tile(T),
        )
    return out


def _launch_groups(rewards: torch.Tensor, group_size: int, mode: int, eps: float) -> torch.Tensor:
    B = rewards.shape[0]
    out = torch.empty_like(rewards)
    if B == 0:
        return out
    std = torch.empty(1, dtype=torch.float32, device=rewards.device)
    if mode == 2:
        _batch_std_kernel[(1,)](rewards, std, B, BLOCK=_tile(B))
    factor = group_size / (group_size - 1) if mode == 3 else 1.0
    _group_kernel[(B // group_size,)](rewards, out, std, group_size, eps, factor, MODE=mode, BLOCK=_tile(group_size))
    return out


@torch.library.custom_op("palestra_triton::group_advantages", mutates_args=())
def group_advantages(rewards: torch.Tensor, group_size: int, scale: int, eps: float) -> torch.Tensor:
    return _launch_groups(rewards, group_size, scale, eps)


@torch.library.custom_op("palestra_triton::rloo_advantages", mutates_args=())
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return _launch_groups(rewards, group_size, 3, 0.0)


def _floats_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=torch.float32, device=t.device)


@gae.register_fake
def _(rewards, values, mask, bootstrap_value, gamma, lam):
    return _floats_like(rewards), _floats_like(rewards)


@discounted_returns.register_fake
def _(rewards, mask, gamma):
    return _floats_like(rewards)


@group_advantages.register_fake
def _(rewards, group_size, scale, eps):
    return _floats_like(rewards)


@rloo_advantages.register_fake
def _(rewards, group_size):
    return _floats_like(rewards)
